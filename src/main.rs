//! `ql-agent`: the QingLong Edge worker daemon.
//!
//! This first cut only reports its version and the protocol it speaks; the daemon itself
//! (session, claims, execution, journal) lands with the agent work.

use argh::FromArgs;

// The main loop that drives these lands separately; until then they are only tested.
#[allow(dead_code, unused_imports)]
mod exec;
#[allow(dead_code, unused_imports)]
mod journal;

/// QingLong Edge agent: runs scheduled scripts handed out by ql-control.
#[derive(FromArgs)]
struct Cli {
    #[argh(subcommand)]
    command: Command,
}

#[derive(FromArgs)]
#[argh(subcommand)]
enum Command {
    Version(Version),
}

/// Print the agent's version and the protocol it speaks.
#[derive(FromArgs)]
#[argh(subcommand, name = "version")]
struct Version {}

fn main() {
    let cli: Cli = argh::from_env();
    match cli.command {
        Command::Version(Version {}) => {
            println!("ql-agent {} (protocol {})", env!("CARGO_PKG_VERSION"), ql_wire::spec::SpecSchema::TEXT);
        }
    }
}
