//! Request framing rules (PROTOCOL §2 and §9), checked on the headers alone, before any
//! body byte is read.
//!
//! One body syntax per route: exactly the route's media type, identity encoding, and one
//! exact `Content-Length` within the route's cap. Anything that would need a second
//! parser — chunked transfer, compression, media type parameters, repeated headers — is
//! refused rather than interpreted.

use hyper::header::{HeaderMap, HeaderName, CONTENT_ENCODING, CONTENT_LENGTH, CONTENT_TYPE, TRANSFER_ENCODING};
use ql_wire::route::Route;
use ql_wire::ErrorCode;

/// Checks the framing headers of a request for `route` and returns its exact body length.
///
/// In order: `Content-Type` must be exactly the route's media type (415), any
/// `Content-Encoding` must be `identity` (415), `Transfer-Encoding` must be absent (411),
/// `Content-Length` must be present once (411) and within the route's cap (413).
pub fn check(route: &Route, headers: &HeaderMap) -> Result<u64, ErrorCode> {
    check_body(route.media_type(), route.body_cap(), headers)
}

/// [`check`] for a body of `media` type of at most `cap` bytes (the identity routes).
pub fn check_body(media: &str, cap: u64, headers: &HeaderMap) -> Result<u64, ErrorCode> {
    let media_type = single(headers, &CONTENT_TYPE).ok_or(ErrorCode::UnsupportedMediaType)?;
    if !media_type.eq_ignore_ascii_case(media) {
        return Err(ErrorCode::UnsupportedMediaType);
    }
    if headers.contains_key(CONTENT_ENCODING) {
        let encoding = single(headers, &CONTENT_ENCODING).ok_or(ErrorCode::UnsupportedMediaType)?;
        if !encoding.eq_ignore_ascii_case("identity") {
            return Err(ErrorCode::UnsupportedMediaType);
        }
    }
    if headers.contains_key(TRANSFER_ENCODING) {
        return Err(ErrorCode::LengthRequired);
    }
    let length = single(headers, &CONTENT_LENGTH).ok_or(ErrorCode::LengthRequired)?;
    if length.is_empty() || !length.bytes().all(|b| b.is_ascii_digit()) {
        return Err(ErrorCode::LengthRequired);
    }
    // Digits only, so the one parse failure left is overflow: certainly over any cap.
    let length: u64 = length.parse().map_err(|_| ErrorCode::PayloadTooLarge)?;
    if length > cap {
        return Err(ErrorCode::PayloadTooLarge);
    }
    Ok(length)
}

/// The header's value when it appears exactly once and is visible ASCII.
fn single<'h>(headers: &'h HeaderMap, name: &HeaderName) -> Option<&'h str> {
    let mut values = headers.get_all(name).iter();
    let value = values.next()?;
    if values.next().is_some() {
        return None;
    }
    value.to_str().ok().map(str::trim)
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::header::HeaderValue;
    use ql_wire::ids::{ArtifactId, AttemptId, RunId, SessionId, WorkerId};
    use ql_wire::route::{AttemptCommand, AttemptPath, ARTIFACT_MEDIA_TYPE, JSON_MEDIA_TYPE};

    fn path() -> AttemptPath {
        AttemptPath {
            worker: WorkerId::parse("r1").unwrap(),
            session: SessionId::parse("s1").unwrap(),
            run: RunId::parse("run1").unwrap(),
            attempt: AttemptId::parse("a1").unwrap(),
        }
    }

    fn artifact() -> Route {
        Route::Artifact(path(), ArtifactId::parse("log").unwrap())
    }

    fn json() -> Route {
        Route::Attempt(path(), AttemptCommand::Starting)
    }

    fn headers(pairs: &[(&HeaderName, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(*name, HeaderValue::from_str(value).unwrap());
        }
        map
    }

    #[test]
    fn exact_framing_is_admitted_with_its_length() {
        let h = headers(&[(&CONTENT_TYPE, JSON_MEDIA_TYPE), (&CONTENT_LENGTH, "17")]);
        assert_eq!(check(&json(), &h), Ok(17));
        let h =
            headers(&[(&CONTENT_TYPE, ARTIFACT_MEDIA_TYPE), (&CONTENT_ENCODING, "identity"), (&CONTENT_LENGTH, "9")]);
        assert_eq!(check(&artifact(), &h), Ok(9));
    }

    #[test]
    fn media_type_must_be_the_routes_and_unparameterised() {
        for ct in ["application/octet-stream", "application/json; charset=utf-8", "text/plain", ""] {
            let h = headers(&[(&CONTENT_TYPE, ct), (&CONTENT_LENGTH, "1")]);
            assert_eq!(check(&json(), &h), Err(ErrorCode::UnsupportedMediaType), "{ct:?}");
        }
        let h = headers(&[(&CONTENT_TYPE, JSON_MEDIA_TYPE), (&CONTENT_LENGTH, "1")]);
        assert_eq!(check(&artifact(), &h), Err(ErrorCode::UnsupportedMediaType));
        let h = headers(&[(&CONTENT_LENGTH, "1")]);
        assert_eq!(check(&json(), &h), Err(ErrorCode::UnsupportedMediaType));
        let twice =
            headers(&[(&CONTENT_TYPE, JSON_MEDIA_TYPE), (&CONTENT_TYPE, JSON_MEDIA_TYPE), (&CONTENT_LENGTH, "1")]);
        assert_eq!(check(&json(), &twice), Err(ErrorCode::UnsupportedMediaType));
    }

    #[test]
    fn only_identity_encoding_is_accepted() {
        for ce in ["gzip", "br", "identity, gzip", "deflate"] {
            let h = headers(&[(&CONTENT_TYPE, JSON_MEDIA_TYPE), (&CONTENT_ENCODING, ce), (&CONTENT_LENGTH, "1")]);
            assert_eq!(check(&json(), &h), Err(ErrorCode::UnsupportedMediaType), "{ce}");
        }
    }

    #[test]
    fn chunked_or_missing_length_is_length_required() {
        let h = headers(&[(&CONTENT_TYPE, JSON_MEDIA_TYPE), (&TRANSFER_ENCODING, "chunked")]);
        assert_eq!(check(&json(), &h), Err(ErrorCode::LengthRequired));
        let h = headers(&[(&CONTENT_TYPE, JSON_MEDIA_TYPE), (&TRANSFER_ENCODING, "chunked"), (&CONTENT_LENGTH, "1")]);
        assert_eq!(check(&json(), &h), Err(ErrorCode::LengthRequired));
        let h = headers(&[(&CONTENT_TYPE, JSON_MEDIA_TYPE)]);
        assert_eq!(check(&json(), &h), Err(ErrorCode::LengthRequired));
        let h = headers(&[(&CONTENT_TYPE, JSON_MEDIA_TYPE), (&CONTENT_LENGTH, "+1")]);
        assert_eq!(check(&json(), &h), Err(ErrorCode::LengthRequired));
    }

    #[test]
    fn length_over_the_routes_cap_is_too_large() {
        let h = headers(&[(&CONTENT_TYPE, JSON_MEDIA_TYPE), (&CONTENT_LENGTH, "4097")]);
        assert_eq!(check(&json(), &h), Err(ErrorCode::PayloadTooLarge));
        let h = headers(&[(&CONTENT_TYPE, JSON_MEDIA_TYPE), (&CONTENT_LENGTH, "4096")]);
        assert_eq!(check(&json(), &h), Ok(4096));
        let cap = artifact().body_cap();
        let h = headers(&[(&CONTENT_TYPE, ARTIFACT_MEDIA_TYPE), (&CONTENT_LENGTH, &(cap + 1).to_string())]);
        assert_eq!(check(&artifact(), &h), Err(ErrorCode::PayloadTooLarge));
        let h = headers(&[(&CONTENT_TYPE, ARTIFACT_MEDIA_TYPE), (&CONTENT_LENGTH, "99999999999999999999999")]);
        assert_eq!(check(&artifact(), &h), Err(ErrorCode::PayloadTooLarge));
    }
}
