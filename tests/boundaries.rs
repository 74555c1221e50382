//! Architecture invariants that the compiler alone does not enforce, checked against the
//! real dependency graph with `cargo tree`.

use std::process::Command;

/// Crates of the server side, or TLS backends that cannot build for mips routers.
const FORBIDDEN_IN_AGENT: &[&str] = &[
    "ql-control",
    "tokio",
    "hyper",
    "rusqlite",
    "libsqlite3-sys",
    "tokio-postgres",
    "postgres",
    "sqlx",
    "aws-lc-rs",
    "aws-lc-sys",
    "openssl",
    "openssl-sys",
    "webpki-roots",
];

/// Packages (names only) in the normal and build dependency graph of `args`.
fn tree(args: &[&str]) -> Vec<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args(["tree", "--locked", "--prefix", "none", "--format", "{p}", "-e", "normal,build"])
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo tree runs");
    assert!(out.status.success(), "cargo tree failed: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    text.lines().filter_map(|l| l.split_whitespace().next()).map(str::to_owned).collect()
}

#[test]
fn the_agent_links_nothing_of_the_server() {
    let agent = tree(&["-p", "ql-agent", "--target", "all"]);
    assert!(agent.iter().any(|p| p == "ql-wire"), "the tree looks wrong: {agent:?}");
    let found: Vec<&String> = agent.iter().filter(|p| FORBIDDEN_IN_AGENT.contains(&p.as_str())).collect();
    assert!(found.is_empty(), "ql-agent depends on {found:?}");
}

#[test]
fn the_contract_crate_stays_pure() {
    let wire = tree(&["-p", "ql-wire", "--target", "all"]);
    let io = ["tokio", "smol", "async-io", "mio", "socket2", "rustls", "ureq", "hyper", "rusqlite", "ql-control"];
    let found: Vec<&String> = wire.iter().filter(|p| io.contains(&p.as_str())).collect();
    assert!(found.is_empty(), "ql-wire depends on {found:?}");
}

#[test]
fn no_aws_lc_anywhere_in_the_workspace() {
    let all = tree(&["--workspace", "--target", "all"]);
    for banned in ["aws-lc-rs", "aws-lc-sys", "openssl-sys"] {
        assert!(!all.iter().any(|p| p == banned), "{banned} is in the workspace tree");
    }
}
