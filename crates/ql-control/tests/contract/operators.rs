//! The operator-credential scenarios of the store contract: a name is taken once, a
//! credential is kept as its digest only, and removing it leaves the others.

use ql_control::core::{authorize, Command, Reply};
use ql_control::model::Role;
use ql_control::store::Store;
use ql_wire::capability::Token;

use super::*;

pub async fn an_operator_credential_is_added_once_and_removed_once<B: Backend>(b: B) {
    let store = b.store();
    let (reader, admin) = (Token::generate().unwrap(), Token::generate().unwrap());
    let added = exec(&store, Command::AddOperator("viewer".into(), Role::Read, reader.digest())).await;
    assert!(matches!(added, Ok(Reply::Operator(o)) if o.role == Role::Read && o.token_digest == reader.digest()));
    assert!(exec(&store, Command::AddOperator("boss".into(), Role::Admin, admin.digest())).await.is_ok());
    refused(
        &store,
        Command::AddOperator("viewer".into(), Role::Admin, admin.digest()),
        ErrorCode::StateConflict,
        "a taken name",
    )
    .await;
    refused(
        &store,
        Command::AddOperator("Bad Name".into(), Role::Admin, admin.digest()),
        ErrorCode::InvalidRequest,
        "a bad name",
    )
    .await;
    refused(&store, Command::RemoveOperator("nobody".into()), ErrorCode::NotFound, "an unknown name").await;

    let operators = store.operators().await.unwrap();
    let names: Vec<&str> = operators.iter().map(|o| o.name.as_str()).collect();
    assert_eq!(names, ["boss", "viewer"]);
    let viewer = operators.iter().find(|o| o.name == "viewer");
    assert_eq!(authorize(viewer, &reader.digest(), Role::Read), Ok(Role::Read));
    assert_eq!(authorize(viewer, &reader.digest(), Role::Admin), Err(ErrorCode::Forbidden));
    assert_eq!(authorize(viewer, &admin.digest(), Role::Read), Err(ErrorCode::Unauthenticated));

    assert!(exec(&store, Command::RemoveOperator("viewer".into())).await.is_ok());
    let left: Vec<String> = store.operators().await.unwrap().into_iter().map(|o| o.name).collect();
    assert_eq!(left, ["boss"]);
    assert_eq!(store.snapshot().await.unwrap().operators.len(), 1);
}
