//! Operator credentials: adding and removing one, and checking the bearer token of an
//! operator API request against the recorded digest.
//!
//! A token is `<name>.<secret>`; the authority keeps the secret's SHA-256 only, so a copy
//! of the database grants nothing. The check is constant-time in the secret and says the
//! same (`unauthenticated`) for an unknown name and a wrong secret.

use ql_wire::capability::Digest;
use ql_wire::ErrorCode;

use super::{Decision, Reply, Rows, Write};
use crate::model::{Millis, Operator, Role};

/// Records a new operator credential; a name already taken is `state_conflict` (remove it
/// first, so a token is never silently replaced).
pub(super) fn add(name: &str, role: Role, digest: &Digest, rows: &Rows, now: Millis) -> Decision {
    if check_name(name).is_err() {
        return Decision::refuse(ErrorCode::InvalidRequest);
    }
    if rows.operator.is_some() {
        return Decision::refuse(ErrorCode::StateConflict);
    }
    let operator = Operator { name: name.to_owned(), role, token_digest: digest.clone(), created_at: now };
    Decision::apply(Reply::Operator(Box::new(operator.clone())), vec![Write::Operator(operator)])
}

/// Removes an operator credential: its token is refused from the next request on.
pub(super) fn remove(name: &str, rows: &Rows) -> Decision {
    match &rows.operator {
        None => Decision::refuse(ErrorCode::NotFound),
        Some(o) => Decision::apply(Reply::Operator(Box::new(o.clone())), vec![Write::RemoveOperator(name.to_owned())]),
    }
}

/// An operator name: `[a-z0-9][a-z0-9._-]{0,62}`, the part of a token before its last dot.
pub fn check_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name.bytes().next().is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(format!("{name:?} is not an operator name ([a-z0-9][a-z0-9._-]{{0,62}})"))
    }
}

/// Whether the credential `found` (looked up by the token's name) with the secret's digest
/// `presented` may do what `needed` allows: its role, or `unauthenticated` (no such
/// credential, or another secret), or `forbidden` (a role that does not allow it).
pub fn authorize(found: Option<&Operator>, presented: &Digest, needed: Role) -> Result<Role, ErrorCode> {
    let Some(operator) = found.filter(|o| o.token_digest.ct_eq(presented)) else {
        return Err(ErrorCode::Unauthenticated);
    };
    if operator.role.allows(needed) {
        Ok(operator.role)
    } else {
        Err(ErrorCode::Forbidden)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ql_wire::capability::Token;

    fn operator(role: Role, token: &Token) -> Operator {
        Operator { name: "ops".into(), role, token_digest: token.digest(), created_at: 1 }
    }

    #[test]
    fn a_token_grants_its_role_and_no_more() {
        let token = Token::generate().unwrap();
        let other = Token::generate().unwrap();
        let reader = operator(Role::Read, &token);
        let admin = operator(Role::Admin, &token);
        assert_eq!(authorize(Some(&reader), &token.digest(), Role::Read), Ok(Role::Read));
        assert_eq!(authorize(Some(&reader), &token.digest(), Role::Admin), Err(ErrorCode::Forbidden));
        assert_eq!(authorize(Some(&admin), &token.digest(), Role::Admin), Ok(Role::Admin));
        assert_eq!(authorize(Some(&admin), &token.digest(), Role::Read), Ok(Role::Admin));
        assert_eq!(authorize(Some(&admin), &other.digest(), Role::Read), Err(ErrorCode::Unauthenticated));
        assert_eq!(authorize(None, &token.digest(), Role::Read), Err(ErrorCode::Unauthenticated));
    }

    #[test]
    fn a_name_is_taken_once_and_removed_once() {
        let token = Token::generate().unwrap();
        let added = add("ops", Role::Read, &token.digest(), &Rows::default(), 5);
        assert_eq!(added.writes, vec![Write::Operator(operator(Role::Read, &token).with_created(5))]);
        let taken = Rows { operator: Some(operator(Role::Admin, &token)), ..Rows::default() };
        assert_eq!(add("ops", Role::Read, &token.digest(), &taken, 5), Decision::refuse(ErrorCode::StateConflict));
        assert_eq!(
            add("Ops", Role::Read, &token.digest(), &Rows::default(), 5),
            Decision::refuse(ErrorCode::InvalidRequest)
        );
        assert_eq!(remove("ops", &Rows::default()), Decision::refuse(ErrorCode::NotFound));
        assert_eq!(remove("ops", &taken).writes, vec![Write::RemoveOperator("ops".into())]);
    }

    impl Operator {
        fn with_created(self, created_at: Millis) -> Self {
            Self { created_at, ..self }
        }
    }
}
