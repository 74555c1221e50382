//! The artifact frame codec, against every refusal rule and every split of the input.

use ql_wire::artifact::{ArtifactHeader, ArtifactSchema};
use ql_wire::capability::Token;
use ql_wire::frame::{encode_prefix, FrameDecoder, FrameError, Item, LogChunkDecoder};
use ql_wire::ids::ArtifactId;
use ql_wire::ids::{Counter, OfferId};
use ql_wire::log::{LogChunkHeader, LogChunkSchema};
use ql_wire::{DecodeError, Fence};

fn fence() -> Fence {
    Fence {
        session_generation: Counter::ONE,
        offer_id: OfferId::parse("off_1").unwrap(),
        lease_generation: Counter::ONE,
        lease_token: Token::from_bytes(&std::array::from_fn(|i| i as u8 * 7)).unwrap(),
        expected_lease_version: Counter::new(2).unwrap(),
    }
}

fn header(len: u64) -> ArtifactHeader {
    ArtifactHeader::new(fence(), ArtifactSchema, len, false)
}

fn frame(content: &[u8]) -> Vec<u8> {
    let mut body = encode_prefix(&header(content.len() as u64)).unwrap().to_vec();
    body.extend_from_slice(content);
    body
}

/// Decodes `body` fed in the given slices; returns the header and the content.
fn run(declared: u64, slices: &[&[u8]]) -> Result<(ArtifactHeader, Vec<u8>), FrameError> {
    let mut dec = FrameDecoder::new(declared)?;
    let mut found = None;
    let mut content = Vec::new();
    for slice in slices {
        let mut input = *slice;
        while let Some(item) = dec.next(&mut input)? {
            match item {
                Item::Header(h) => {
                    assert!(found.is_none() && content.is_empty(), "header must come once, first");
                    found = Some(h);
                }
                Item::Content(c) => {
                    assert!(found.is_some(), "content before header");
                    content.extend_from_slice(c);
                }
            }
        }
        assert!(input.is_empty(), "decoder left input unconsumed");
    }
    dec.finish()?;
    Ok((found.expect("no header"), content))
}

#[test]
fn every_split_point_gives_the_same_result() {
    let content: Vec<u8> = (0..300u32).map(|i| (i * 31 % 251) as u8).collect();
    let body = frame(&content);
    let expected = run(body.len() as u64, &[&body]).unwrap();
    assert_eq!(expected.1, content);
    assert_eq!(expected.0, header(300));
    for split in 0..=body.len() {
        let (a, b) = body.split_at(split);
        assert_eq!(run(body.len() as u64, &[a, b]).unwrap(), expected, "split at {split}");
    }
    for split in 0..body.len() {
        for second in split..=body.len() {
            let parts = [&body[..split], &body[split..second], &body[second..]];
            if second % 37 == 0 {
                assert_eq!(run(body.len() as u64, &parts).unwrap(), expected, "splits at {split},{second}");
            }
        }
    }
    let bytes: Vec<&[u8]> = body.chunks(1).collect();
    assert_eq!(run(body.len() as u64, &bytes).unwrap(), expected);
}

#[test]
fn empty_content_is_a_valid_frame() {
    let body = frame(b"");
    assert_eq!(run(body.len() as u64, &[&body]).unwrap().1, b"");
}

#[test]
fn content_slices_borrow_the_input() {
    let body = frame(&[7u8; 1000]);
    let mut dec = FrameDecoder::new(body.len() as u64).unwrap();
    let mut input = &body[..];
    assert!(matches!(dec.next(&mut input).unwrap(), Some(Item::Header(_))));
    match dec.next(&mut input).unwrap() {
        Some(Item::Content(c)) => {
            assert_eq!(c.len(), 1000);
            assert_eq!(c.as_ptr(), body[body.len() - 1000..].as_ptr(), "content was copied");
        }
        other => panic!("expected content, got {other:?}"),
    }
    assert_eq!(dec.remaining(), Some(0));
}

#[test]
fn refuses_header_length_zero() {
    let mut body = vec![0, 0, 0, 0];
    body.extend_from_slice(b"{}");
    assert_eq!(run(body.len() as u64, &[&body]).unwrap_err(), FrameError::HeaderLength(0));
}

#[test]
fn refuses_header_length_over_4096() {
    let mut body = 4097u32.to_be_bytes().to_vec();
    body.extend(std::iter::repeat_n(b' ', 5000));
    assert_eq!(run(body.len() as u64, &[&body]).unwrap_err(), FrameError::HeaderLength(4097));
}

#[test]
fn encoder_refuses_content_over_64_mib() {
    assert!(matches!(encode_prefix(&header(64 * 1024 * 1024 + 1)), Err(FrameError::Header(DecodeError::Invalid(_)))));
    assert!(encode_prefix(&header(64 * 1024 * 1024)).is_ok());
}

fn raw_frame(header_json: &str, content: &[u8]) -> Vec<u8> {
    let mut body = (header_json.len() as u32).to_be_bytes().to_vec();
    body.extend_from_slice(header_json.as_bytes());
    body.extend_from_slice(content);
    body
}

fn header_json(len: u64) -> serde_json::Value {
    serde_json::to_value(header(len)).unwrap()
}

#[test]
fn refuses_a_header_that_is_not_json() {
    let body = raw_frame("not json at all", b"");
    assert!(matches!(run(body.len() as u64, &[&body]), Err(FrameError::Header(DecodeError::Malformed(_)))));
}

#[test]
fn refuses_a_header_with_unknown_fields() {
    let mut h = header_json(3);
    h["workerId"] = "r1".into();
    let body = raw_frame(&h.to_string(), b"abc");
    let err = run(body.len() as u64, &[&body]).unwrap_err();
    assert!(err.to_string().contains("unknown field"), "{err}");
}

#[test]
fn refuses_a_wrong_schema() {
    let mut h = header_json(3);
    h["schema"] = "qinglong/remote-worker-artifact-upload@v2".into();
    let body = raw_frame(&h.to_string(), b"abc");
    assert!(matches!(run(body.len() as u64, &[&body]), Err(FrameError::Header(DecodeError::Malformed(_)))));
}

#[test]
fn refuses_content_length_that_disagrees_with_the_body() {
    // Header says 5 bytes, body carries 3 and declares exactly what it carries.
    let h = header_json(5).to_string();
    let body = raw_frame(&h, b"abc");
    let declared = body.len() as u64;
    assert_eq!(run(declared, &[&body]).unwrap_err(), FrameError::LengthMismatch { declared, implied: declared + 2 });
}

#[test]
fn refuses_a_body_shorter_than_declared() {
    let body = frame(b"abcdef");
    let cut = &body[..body.len() - 2];
    assert_eq!(run(body.len() as u64, &[cut]).unwrap_err(), FrameError::Short { missing: 2 });
    // Ending inside the length prefix or the header is short too.
    assert!(matches!(run(body.len() as u64, &[&body[..2]]), Err(FrameError::Short { .. })));
    assert!(matches!(run(body.len() as u64, &[&body[..10]]), Err(FrameError::Short { .. })));
}

#[test]
fn refuses_a_body_longer_than_declared() {
    let mut body = frame(b"abcdef");
    let declared = body.len() as u64;
    body.push(b'!');
    assert_eq!(run(declared, &[&body]).unwrap_err(), FrameError::Long);
    let bytes: Vec<&[u8]> = body.chunks(1).collect();
    assert_eq!(run(declared, &bytes).unwrap_err(), FrameError::Long);
}

#[test]
fn refuses_a_declared_length_over_the_route_cap() {
    let cap = 64 * 1024 * 1024 + 4096 + 4;
    assert!(FrameDecoder::new(cap).is_ok());
    assert_eq!(FrameDecoder::new(cap + 1).err(), Some(FrameError::TooLarge { declared: cap + 1 }));
    assert_eq!(FrameDecoder::new(4).err(), Some(FrameError::TooSmall { declared: 4 }));
}

#[test]
fn a_refused_decoder_stays_refused() {
    let mut body = vec![0, 0, 0, 0];
    body.extend_from_slice(b"{}");
    let mut dec = FrameDecoder::new(body.len() as u64).unwrap();
    let mut input = &body[..];
    assert!(dec.next(&mut input).is_err());
    let mut more: &[u8] = b"x";
    assert_eq!(dec.next(&mut more).unwrap_err(), FrameError::Refused);
    assert_eq!(dec.finish().unwrap_err(), FrameError::Refused);
}

#[test]
fn the_encoded_prefix_starts_with_the_big_endian_header_length() {
    let prefix = encode_prefix(&header(0)).unwrap();
    let h = u32::from_be_bytes(prefix[..4].try_into().unwrap()) as usize;
    assert_eq!(h, prefix.len() - 4);
    let json: serde_json::Value = serde_json::from_slice(&prefix[4..]).unwrap();
    assert_eq!(json["schema"], "qinglong/remote-worker-artifact-upload@v1");
    assert_eq!(json["contentLength"], 0);
}

#[test]
fn a_log_chunk_travels_in_the_same_frame_with_its_own_header_and_cap() {
    let header = LogChunkHeader::new(fence(), LogChunkSchema, ArtifactId::parse("log").unwrap(), 512, 3);
    let mut body = encode_prefix(&header).unwrap().to_vec();
    body.extend_from_slice(b"abc");
    let mut dec = LogChunkDecoder::new(body.len() as u64).unwrap();
    let mut input: &[u8] = &body;
    assert_eq!(dec.next(&mut input).unwrap(), Some(Item::Header(header.clone())));
    assert_eq!(dec.next(&mut input).unwrap(), Some(Item::Content(&b"abc"[..])));
    dec.finish().unwrap();
    assert_eq!(header.end(), 515);

    // An artifact header is no chunk header, and a chunk frame has the smaller cap.
    let artifact = frame(b"abc");
    let mut dec = LogChunkDecoder::new(artifact.len() as u64).unwrap();
    let mut input: &[u8] = &artifact;
    assert!(matches!(dec.next(&mut input), Err(FrameError::Header(_))));
    let cap = 4 + 4096 + 256 * 1024;
    assert!(LogChunkDecoder::new(cap).is_ok());
    assert_eq!(LogChunkDecoder::new(cap + 1).err(), Some(FrameError::TooLarge { declared: cap + 1 }));
    let too_long = LogChunkHeader::new(fence(), LogChunkSchema, ArtifactId::parse("log").unwrap(), 0, 256 * 1024 + 1);
    assert!(matches!(encode_prefix(&too_long), Err(FrameError::Header(DecodeError::Invalid(_)))));
}
