//! The server's own keys and their one use, HMAC-SHA256 (ring): the key files replicas
//! share (the webhook key, the dashboard's), the hex form signatures travel in, and the
//! constant-time check of a presented one.

use std::path::Path;

use zeroize::Zeroizing;

/// The key in `path`, made (32 random bytes, base64url, mode 0600) when absent.
pub fn key_file(path: &Path) -> Result<Zeroizing<String>, String> {
    if !path.exists() {
        use std::io::Write as _;
        use std::os::unix::fs::OpenOptionsExt as _;
        // 32 random bytes, base64url: a token's text.
        let token = ql_wire::capability::Token::generate().map_err(|e| format!("no randomness: {e}"))?;
        let text = Zeroizing::new(token.expose().to_owned());
        let created = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path);
        match created {
            Ok(mut f) => f
                .write_all(text.as_bytes())
                .and_then(|()| f.sync_all())
                .map_err(|e| format!("{}: {e}", path.display()))?,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(format!("{}: {e}", path.display())),
        }
    }
    let key = crate::pki::read_secret(path).map_err(|e| e.to_string())?;
    let key = Zeroizing::new(key.trim().to_owned());
    if key.len() < 16 {
        return Err(format!("{}: a key of at least 16 characters", path.display()));
    }
    Ok(key)
}

/// HMAC-SHA256 of `text` under `key`.
pub fn hmac(key: &[u8], text: &[u8]) -> Vec<u8> {
    ring::hmac::sign(&ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key), text).as_ref().to_vec()
}

/// The same, in lowercase hex.
pub fn hmac_hex(key: &[u8], text: &[u8]) -> String {
    hex(&hmac(key, text))
}

/// Whether `given` (hex) is the HMAC-SHA256 of `text` under `key`, in constant time.
pub fn hmac_valid(key: &[u8], text: &[u8], given: &str) -> bool {
    let Some(tag) = unhex(given) else { return false };
    ring::hmac::verify(&ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key), text, &tag).is_ok()
}

/// Lowercase hex.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The bytes of hex text, or `None` for anything else.
fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) || !text.is_ascii() {
        return None;
    }
    (0..text.len()).step_by(2).map(|i| u8::from_str_radix(&text[i..i + 2], 16).ok()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signature_is_checked_against_its_key_and_text() {
        let tag = hmac_hex(b"key", b"text");
        assert!(hmac_valid(b"key", b"text", &tag));
        assert!(!hmac_valid(b"other", b"text", &tag));
        assert!(!hmac_valid(b"key", b"other", &tag));
        for bad in ["", "zz", "é", &tag[1..]] {
            assert!(!hmac_valid(b"key", b"text", bad), "{bad:?}");
        }
    }
}
