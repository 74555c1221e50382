//! Golden fixtures: one valid JSON per message (plus variants), and the invalid variants
//! that matter. Valid ones must decode, validate and re-encode to the same JSON; invalid
//! ones must be refused. A file's type is the longest known message name its stem starts
//! with (`claimed_script.json` is a `claimed`, `running.handle_empty.json` a `running`).

use std::fs;
use std::path::Path;

use ql_wire::ack::{Abandon, AckReply, Running, StartFailure};
use ql_wire::artifact::{ArtifactHeader, ArtifactReply};
use ql_wire::completion::{Completion, CompletionReply};
use ql_wire::enrol::{CaBundle, Enrol, Issued, Renew};
use ql_wire::lease::Renewed;
use ql_wire::log::{LogAppendReply, LogChunkHeader, Seal};
use ql_wire::offer::{Claim, Claimed, Offers, PollOffers};
use ql_wire::session::{CloseSession, Heartbeat, HeartbeatReply, OpenSession, SessionClosed, SessionOpened};
use ql_wire::{decode, encode, Body, DecodeError, ErrorBody, Fence};

type Check = fn(&[u8]) -> Result<serde_json::Value, DecodeError>;

fn check<T: Body>(bytes: &[u8]) -> Result<serde_json::Value, DecodeError> {
    let body: T = decode(bytes)?;
    Ok(serde_json::from_slice(&encode(&body)).expect("encoded JSON parses"))
}

const TYPES: &[(&str, Check)] = &[
    ("open_session", check::<OpenSession>),
    ("session_opened", check::<SessionOpened>),
    ("heartbeat", check::<Heartbeat>),
    ("heartbeat_reply", check::<HeartbeatReply>),
    ("close_session", check::<CloseSession>),
    ("session_closed", check::<SessionClosed>),
    ("poll_offers", check::<PollOffers>),
    ("offers", check::<Offers>),
    ("claim", check::<Claim>),
    ("claimed", check::<Claimed>),
    ("fence", check::<Fence>),
    ("running", check::<Running>),
    ("start_failure", check::<StartFailure>),
    ("abandon", check::<Abandon>),
    ("ack_reply", check::<AckReply>),
    ("renewed", check::<Renewed>),
    ("artifact_header", check::<ArtifactHeader>),
    ("artifact_reply", check::<ArtifactReply>),
    ("log_chunk_header", check::<LogChunkHeader>),
    ("log_append_reply", check::<LogAppendReply>),
    ("seal", check::<Seal>),
    ("completion", check::<Completion>),
    ("completion_reply", check::<CompletionReply>),
    ("error_body", check::<ErrorBody>),
    ("enrol", check::<Enrol>),
    ("renew", check::<Renew>),
    ("issued", check::<Issued>),
    ("ca_bundle", check::<CaBundle>),
];

fn checker(stem: &str) -> (&'static str, Check) {
    TYPES
        .iter()
        .filter(|(name, _)| stem.starts_with(name))
        .max_by_key(|(name, _)| name.len())
        .copied()
        .unwrap_or_else(|| panic!("fixture {stem} names no known message"))
}

fn fixtures(kind: &str) -> Vec<(String, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(kind);
    let mut all: Vec<_> = fs::read_dir(&dir)
        .unwrap()
        .map(|e| {
            let path = e.unwrap().path();
            (path.file_stem().unwrap().to_string_lossy().into_owned(), fs::read(&path).unwrap())
        })
        .collect();
    all.sort();
    all
}

#[test]
fn every_valid_fixture_decodes_and_round_trips_exactly() {
    let all = fixtures("valid");
    for (stem, bytes) in &all {
        let (_, check) = checker(stem);
        let reencoded = check(bytes).unwrap_or_else(|e| panic!("{stem}: {e}"));
        let original: serde_json::Value = serde_json::from_slice(bytes).unwrap();
        assert_eq!(reencoded, original, "{stem} changed in a round trip");
    }
}

#[test]
fn every_message_type_has_a_valid_fixture() {
    let stems: Vec<String> = fixtures("valid").into_iter().map(|(s, _)| s).collect();
    for (name, _) in TYPES {
        assert!(stems.iter().any(|s| checker(s).0 == *name), "no valid fixture for {name}");
    }
}

#[test]
fn every_invalid_fixture_is_refused() {
    let all = fixtures("invalid");
    assert!(all.len() >= 60, "the invalid fixtures went missing");
    for (stem, bytes) in &all {
        let (_, check) = checker(stem);
        assert!(check(bytes).is_err(), "{stem} was accepted");
    }
}

#[test]
fn invalid_fixtures_fail_for_their_stated_reason() {
    // Spot checks that the refusal is the intended one, not an accident of the fixture.
    let find = |stem: &str| fixtures("invalid").into_iter().find(|(s, _)| s == stem).unwrap().1;
    let err = check::<Claimed>(&find("claimed.argv_and_script")).unwrap_err();
    assert_eq!(err, DecodeError::Invalid(ql_wire::Invalid::ArgvXorScript));
    let err = check::<OpenSession>(&find("open_session.seventeen_labels")).unwrap_err();
    assert_eq!(err, DecodeError::Invalid(ql_wire::Invalid::TooMany { max: 16 }));
    let chunk = |stem| check::<LogChunkHeader>(&find(stem)).unwrap_err();
    let chunk_range = DecodeError::Invalid(ql_wire::Invalid::OutOfRange { min: 1, max: 256 * 1024 });
    assert_eq!(chunk("log_chunk_header.content_zero"), chunk_range);
    assert_eq!(chunk("log_chunk_header.content_over_256kib"), chunk_range);
    let past = DecodeError::Invalid(ql_wire::Invalid::OutOfRange { min: 0, max: 64 * 1024 * 1024 - 1 });
    assert_eq!(chunk("log_chunk_header.past_64mib"), past);
    for stem in ["error_body.conflict_without_acked", "error_body.acked_on_other_code"] {
        assert_eq!(check::<ErrorBody>(&find(stem)).unwrap_err(), DecodeError::Invalid(ql_wire::Invalid::Schema));
    }
    for (stem, needle) in [
        ("fence.unknown_field", "unknown field"),
        ("fence.missing_offer", "missing field"),
        ("claim.weak_token", "distinct"),
        ("running.digest_uppercase", "lowercase hex"),
        ("running.missing_log_artifact_id", "missing field"),
        ("completion.missing_exit_code", "missing field"),
        ("completion.wrong_schema", "schema"),
        ("heartbeat.duplicate_field", "duplicate field"),
        ("log_chunk_header.wrong_schema", "schema"),
        ("log_chunk_header.unknown_field", "unknown field"),
        ("log_chunk_header.missing_offset", "missing field"),
        ("seal.unknown_field", "unknown field"),
        ("seal.missing_truncated", "missing field"),
        ("enrol.weak_token", "distinct"),
        ("enrol.worker_in_body", "unknown field"),
        ("renew.csr_over_2048_bytes", "2048"),
        ("issued.missing_not_after", "missing field"),
    ] {
        let (_, check) = checker(stem);
        let err = check(&find(stem)).unwrap_err().to_string();
        assert!(err.contains(needle), "{stem}: {err}");
    }
}

#[test]
fn bodies_over_their_cap_are_refused_before_parsing() {
    let mut padded = br#"{"generation": 4, "draining": false}"#.to_vec();
    padded.extend(std::iter::repeat_n(b' ', 4096));
    assert_eq!(decode::<Heartbeat>(&padded).unwrap_err(), DecodeError::TooLarge { cap: 4096, len: padded.len() });
    let completion = fixtures("valid").into_iter().find(|(s, _)| s == "completion").unwrap().1;
    let mut big = completion.clone();
    big.truncate(big.len() - 2);
    big.extend(std::iter::repeat_n(b' ', 16 * 1024));
    big.extend_from_slice(b"}\n");
    assert!(matches!(decode::<Completion>(&big), Err(DecodeError::TooLarge { cap: 16384, .. })));
    assert!(decode::<Completion>(&completion).is_ok());
}

#[test]
fn responses_never_echo_a_token() {
    // Reply types have no field that could carry a token or its digest.
    for (stem, bytes) in fixtures("valid") {
        let (name, _) = checker(&stem);
        if name.ends_with("reply") || ["session_opened", "offers", "renewed", "claimed"].contains(&name) {
            let text = String::from_utf8(bytes).unwrap().to_lowercase();
            assert!(!text.contains("token"), "{stem} mentions a token");
        }
    }
}
