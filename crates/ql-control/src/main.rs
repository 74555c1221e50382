//! `ql-control`: the QingLong Edge control plane, the one authority the agents talk to.
//!
//! This first cut only reports its version; the authority lands with the control-plane work.

use argh::FromArgs;

/// QingLong Edge control plane.
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

/// Print the version.
#[derive(FromArgs)]
#[argh(subcommand, name = "version")]
struct Version {}

fn main() {
    let cli: Cli = argh::from_env();
    match cli.command {
        Command::Version(Version {}) => println!("ql-control {}", env!("CARGO_PKG_VERSION")),
    }
}
