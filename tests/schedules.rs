//! Schedules end to end with real processes: a six-field schedule firing every second
//! runs once per fire time on a real agent, and `--overlap skip` with a slow job records
//! the fires it skipped.

mod common;

use common::World;

fn lines_of(out: &std::process::Output) -> Vec<String> {
    String::from_utf8_lossy(&out.stdout).lines().map(str::to_owned).collect()
}

#[test]
fn a_schedule_every_second_runs_once_per_fire_time_and_skip_records_its_skips() {
    let w = World::new("schedules", &[("capacity", "2")]);
    // `--dir` before the `--` that starts the job's argv.
    let add = |args: &[&str], argv: &[&str]| {
        let out = std::process::Command::new(&w.control.bin)
            .args(["schedule", "add"])
            .args(args)
            .arg("--dir")
            .arg(&w.control.dir)
            .arg("--")
            .args(argv)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    };
    add(&["tick", "--cron", "* * * * * *", "--overlap", "allow"], &["sh", "-c", "echo tick"]);
    add(&["slow", "--cron", "* * * * * *"], &["sh", "-c", "sleep 3; echo slow"]);
    let runs_of = |name: &str, status: &str| {
        lines_of(&w.control.cli(&["runs", "--schedule", name, "--status", status])).len().saturating_sub(1)
    };
    common::wait_for(
        "three ticks and a slow run to succeed",
        || w.context(),
        || (runs_of("tick", "succeeded") >= 3 && runs_of("slow", "succeeded") >= 1).then_some(()),
    );
    let pause = w.control.cli(&["schedule", "pause", "tick"]);
    assert!(pause.status.success());
    let pause = w.control.cli(&["schedule", "pause", "slow"]);
    assert!(pause.status.success());

    for name in ["tick", "slow"] {
        let shown = lines_of(&w.control.cli(&["schedule", "show", name]));
        let fires: Vec<&String> = shown.iter().skip_while(|l| *l != "recent fires").skip(1).collect();
        let times: std::collections::BTreeSet<&str> =
            fires.iter().map(|l| l.split_whitespace().next().unwrap()).collect();
        assert_eq!(times.len(), fires.len(), "{name}: no fire time twice:\n{}", shown.join("\n"));
        let queued = fires.iter().filter(|l| l.contains(" queued ")).count();
        let runs = lines_of(&w.control.cli(&["runs", "--schedule", name])).len() - 1;
        assert_eq!(runs, queued, "{name}: one run per queued fire:\n{}", shown.join("\n"));
        if name == "slow" {
            assert!(
                fires.iter().any(|l| l.contains(" skipped ")),
                "the slow job's overlap was skipped:\n{}",
                shown.join("\n")
            );
        }
    }
    let listed = String::from_utf8(w.control.cli(&["schedule", "list"]).stdout).unwrap();
    assert!(listed.lines().any(|l| l.starts_with("tick ") && l.contains(" yes ")), "{listed}");
}
