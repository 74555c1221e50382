//! Base64 without padding, in the two alphabets the protocol uses: base64url (RFC 4648
//! §5) for tokens and certificate requests on the wire, the standard one (§4) for PEM.
//! Decoding is canonical: the spare bits of the last character must be zero and a
//! length no encoding produces is refused, so each byte string has one text.

/// RFC 4648 §5, for tokens and certificate requests.
pub const URL: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
/// RFC 4648 §4, for PEM.
pub const STANDARD: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Encodes `bytes` without padding.
pub fn encode(bytes: &[u8], alphabet: &[u8; 64]) -> String {
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk.iter().enumerate().fold(0u32, |acc, (i, &b)| acc | u32::from(b) << (16 - 8 * i));
        for i in 0..=chunk.len() {
            out.push(char::from(alphabet[(n >> (18 - 6 * i) & 63) as usize]));
        }
    }
    out
}

/// Decodes unpadded text in `alphabet` ([`URL`] or [`STANDARD`]), refusing any other
/// character and any non-canonical text.
pub fn decode(text: &[u8], alphabet: &[u8; 64]) -> Option<Vec<u8>> {
    if text.len() % 4 == 1 {
        return None;
    }
    // Both alphabets share their first 62 characters, in ASCII's order: a range test
    // each, instead of a search of the alphabet for every character.
    let value = |c: u8| match c {
        b'A'..=b'Z' => Some(u32::from(c - b'A')),
        b'a'..=b'z' => Some(u32::from(c - b'a') + 26),
        b'0'..=b'9' => Some(u32::from(c - b'0') + 52),
        _ if c == alphabet[62] => Some(62),
        _ if c == alphabet[63] => Some(63),
        _ => None,
    };
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    let (mut bits, mut nbits) = (0u32, 0);
    for &c in text {
        bits = bits << 6 | value(c)?;
        nbits += 6;
        if nbits >= 8 {
            nbits -= 8;
            out.push((bits >> nbits) as u8);
            bits &= (1 << nbits) - 1;
        }
    }
    (bits == 0).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_vectors_round_trip_in_both_alphabets() {
        // RFC 4648 §10, unpadded.
        for (plain, text) in
            [("", ""), ("f", "Zg"), ("fo", "Zm8"), ("foo", "Zm9v"), ("foob", "Zm9vYg"), ("fooba", "Zm9vYmE")]
        {
            assert_eq!(encode(plain.as_bytes(), URL), text);
            assert_eq!(decode(text.as_bytes(), STANDARD).as_deref(), Some(plain.as_bytes()));
        }
        let all: Vec<u8> = (0..=255).collect();
        assert!(encode(&all, STANDARD).contains('+') && encode(&all, URL).contains('-'));
        assert_eq!(decode(encode(&all, URL).as_bytes(), URL), Some(all));
    }

    #[test]
    fn every_character_of_each_alphabet_decodes_to_its_index_and_no_other_does() {
        for alphabet in [URL, STANDARD] {
            for c in 0..=255u8 {
                // One character then `A` (zero): the first six bits are the character's.
                let decoded = decode(&[c, b'A'], alphabet);
                match alphabet.iter().position(|&a| a == c) {
                    Some(i) => assert_eq!(decoded, Some(vec![(i as u8) << 2]), "{}", char::from(c)),
                    None => assert_eq!(decoded, None, "{}", char::from(c)),
                }
            }
        }
    }

    #[test]
    fn padding_foreign_characters_and_spare_bits_are_refused() {
        for bad in ["Zg==", "Z", "Zh", "Zm9v!", "Zm9v Yg", "+w"] {
            assert_eq!(decode(bad.as_bytes(), URL), None, "{bad}");
        }
    }
}
