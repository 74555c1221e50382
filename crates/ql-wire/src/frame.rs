//! The artifact frame: `u32 BE header length H | header JSON (H bytes) | content (N bytes)`.
//! The same frame carries a live-log chunk (PROTOCOL §13) with its own header type and a
//! smaller cap: [`FrameHeader`] is what differs between the two.
//!
//! [`encode_prefix`] builds the length and header for a known content length; the caller
//! streams the content after it. [`FrameDecoder`] takes the body as it arrives, in slices
//! of any size, and yields the header first, then content slices borrowed from the input:
//! it never buffers content, so its memory does not grow with the artifact. It refuses
//! every malformed frame: a header length of 0 or over 4096, a header that is not JSON,
//! has unknown fields or the wrong schema, a `contentLength` that disagrees with the
//! body's declared length, a body shorter or longer than declared, or a declared length
//! over the route's hard cap.

use std::fmt;
use zeroize::Zeroizing;

use crate::artifact::ArtifactHeader;
use crate::limits::FRAME_HEADER_MAX;
use crate::log::LogChunkHeader;
use crate::{decode, encode_exact, Body, DecodeError};

/// A header that leads a frame: it declares the content's length, and its route caps the
/// whole body.
pub trait FrameHeader: Body {
    /// The route's hard cap: length prefix, largest header, largest content.
    const BODY_CAP: u64;

    /// Bytes of content after the header.
    fn content_length(&self) -> u64;
}

impl FrameHeader for ArtifactHeader {
    const BODY_CAP: u64 = crate::limits::ARTIFACT_BODY_CAP;

    fn content_length(&self) -> u64 {
        self.content_length
    }
}

impl FrameHeader for LogChunkHeader {
    const BODY_CAP: u64 = crate::limits::LOG_CHUNK_BODY_CAP;

    fn content_length(&self) -> u64 {
        self.content_length
    }
}

/// Decodes an artifact frame (PROTOCOL §9).
pub type FrameDecoder = Decoder<ArtifactHeader>;
/// Decodes a live-log chunk frame (PROTOCOL §13).
pub type LogChunkDecoder = Decoder<LogChunkHeader>;

/// Why a frame was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrameError {
    /// The declared body length is over the route's hard cap.
    TooLarge {
        /// The declared length.
        declared: u64,
    },
    /// The declared body cannot even hold a length prefix and a 1-byte header.
    TooSmall {
        /// The declared length.
        declared: u64,
    },
    /// The header length is 0 or over 4096.
    HeaderLength(u32),
    /// The header is not a valid header of the route.
    Header(DecodeError),
    /// `4 + H + contentLength` differs from the declared body length.
    LengthMismatch {
        /// The declared body length.
        declared: u64,
        /// What the header implies.
        implied: u64,
    },
    /// The body ended before the declared length.
    Short {
        /// Bytes still expected.
        missing: u64,
    },
    /// Bytes arrived after the declared length.
    Long,
    /// The decoder was used after it refused the frame.
    Refused,
}

impl fmt::Display for FrameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::TooLarge { declared } => write!(f, "artifact body of {declared} bytes exceeds the route cap"),
            Self::TooSmall { declared } => write!(f, "artifact body of {declared} bytes is too small for a frame"),
            Self::HeaderLength(h) => write!(f, "artifact header length {h} is outside 1..=4096"),
            Self::Header(e) => write!(f, "artifact header: {e}"),
            Self::LengthMismatch { declared, implied } => {
                write!(f, "artifact frame implies {implied} bytes but the body declares {declared}")
            }
            Self::Short { missing } => write!(f, "artifact body ended {missing} bytes early"),
            Self::Long => f.write_str("artifact body is longer than declared"),
            Self::Refused => f.write_str("artifact frame already refused"),
        }
    }
}

impl std::error::Error for FrameError {}

/// The length prefix and header for `header.content_length` bytes of content. It holds the
/// raw lease token, so it wipes itself when dropped.
pub fn encode_prefix<H: FrameHeader>(header: &H) -> Result<Zeroizing<Vec<u8>>, FrameError> {
    header.validate().map_err(|e| FrameError::Header(DecodeError::Invalid(e)))?;
    let json = Zeroizing::new(encode_exact(header));
    if json.len() > FRAME_HEADER_MAX {
        return Err(FrameError::HeaderLength(json.len() as u32));
    }
    let mut prefix = Zeroizing::new(Vec::with_capacity(4 + json.len()));
    prefix.extend_from_slice(&(json.len() as u32).to_be_bytes());
    prefix.extend_from_slice(&json);
    Ok(prefix)
}

/// One thing the decoder found.
#[derive(Debug, PartialEq, Eq)]
pub enum Item<'a, H = ArtifactHeader> {
    /// The header, once, before any content.
    Header(H),
    /// The next slice of content.
    Content(&'a [u8]),
}

enum State {
    Length { buf: [u8; 4], have: usize },
    Header { buf: Zeroizing<Vec<u8>>, want: usize },
    Content { remaining: u64 },
    Refused,
}

/// Decodes one framed body incrementally. See the module doc.
pub struct Decoder<H> {
    declared: u64,
    state: State,
    header: std::marker::PhantomData<H>,
}

impl<H: FrameHeader> Decoder<H> {
    /// A decoder for a body whose Content-Length is `declared`.
    pub fn new(declared: u64) -> Result<Self, FrameError> {
        if declared > H::BODY_CAP {
            return Err(FrameError::TooLarge { declared });
        }
        if declared < 5 {
            return Err(FrameError::TooSmall { declared });
        }
        Ok(Self { declared, state: State::Length { buf: [0; 4], have: 0 }, header: std::marker::PhantomData })
    }

    /// Consumes from the front of `input` and returns the next item, or `None` once
    /// `input` is empty. Call until it returns `None`, then feed the next slice.
    pub fn next<'a>(&mut self, input: &mut &'a [u8]) -> Result<Option<Item<'a, H>>, FrameError> {
        let result = self.step(input);
        if result.is_err() {
            self.state = State::Refused;
        }
        result
    }

    fn step<'a>(&mut self, input: &mut &'a [u8]) -> Result<Option<Item<'a, H>>, FrameError> {
        loop {
            match &mut self.state {
                State::Refused => return Err(FrameError::Refused),
                State::Length { buf, have } => {
                    if input.is_empty() {
                        return Ok(None);
                    }
                    let take = (4 - *have).min(input.len());
                    buf[*have..*have + take].copy_from_slice(&input[..take]);
                    *have += take;
                    *input = &input[take..];
                    if *have == 4 {
                        let h = u32::from_be_bytes(*buf);
                        if h == 0 || h as usize > FRAME_HEADER_MAX {
                            return Err(FrameError::HeaderLength(h));
                        }
                        if 4 + u64::from(h) > self.declared {
                            return Err(FrameError::LengthMismatch {
                                declared: self.declared,
                                implied: 4 + u64::from(h),
                            });
                        }
                        self.state =
                            State::Header { buf: Zeroizing::new(Vec::with_capacity(h as usize)), want: h as usize };
                    }
                }
                State::Header { buf, want } => {
                    if input.is_empty() {
                        return Ok(None);
                    }
                    let take = (*want - buf.len()).min(input.len());
                    buf.extend_from_slice(&input[..take]);
                    *input = &input[take..];
                    if buf.len() == *want {
                        let header: H = decode(buf).map_err(FrameError::Header)?;
                        let content_length = header.content_length();
                        let implied = 4 + *want as u64 + content_length;
                        if implied != self.declared {
                            return Err(FrameError::LengthMismatch { declared: self.declared, implied });
                        }
                        self.state = State::Content { remaining: content_length };
                        return Ok(Some(Item::Header(header)));
                    }
                }
                State::Content { remaining } => {
                    if input.is_empty() {
                        return Ok(None);
                    }
                    if *remaining == 0 {
                        return Err(FrameError::Long);
                    }
                    let take = (*remaining).min(input.len() as u64) as usize;
                    let (content, rest) = input.split_at(take);
                    *remaining -= take as u64;
                    *input = rest;
                    return Ok(Some(Item::Content(content)));
                }
            }
        }
    }

    /// Call at the end of the body: refuses a body that stopped early.
    pub fn finish(&self) -> Result<(), FrameError> {
        match &self.state {
            State::Content { remaining: 0 } => Ok(()),
            State::Content { remaining } => Err(FrameError::Short { missing: *remaining }),
            State::Refused => Err(FrameError::Refused),
            State::Length { have, .. } => Err(FrameError::Short { missing: self.declared - *have as u64 }),
            State::Header { buf, .. } => Err(FrameError::Short { missing: self.declared - 4 - buf.len() as u64 }),
        }
    }

    /// Bytes of content still expected, once the header is known.
    pub fn remaining(&self) -> Option<u64> {
        match self.state {
            State::Content { remaining } => Some(remaining),
            _ => None,
        }
    }
}
