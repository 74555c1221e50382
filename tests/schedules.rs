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

/// A fire missed while ql-control was down follows the schedule's `--catch-up`: `none`
/// records it `missed`, `once` queues one run for it; neither bursts through every second
/// of the outage.
#[test]
fn a_fire_missed_across_a_restart_follows_catch_up() {
    let root = common::TempDir::new("schedules-catch-up");
    let dir = root.0.join("control");
    let settings: Vec<(&str, u64)> =
        common::SHORT_TIMINGS.iter().copied().chain([("schedule_missed_after_ms", 1_000)]).collect();
    common::init_control(common::control_bin(), &dir, &root.0.join("creds"), &settings);
    let err = root.0.join("control.err");
    let control = common::Control::serve(common::control_bin(), &dir, "127.0.0.1:0", &err, &[]);
    // Every second, so the outage misses some; no agent runs them, which fires do not need.
    for (name, catch_up) in [("late-none", "none"), ("late-once", "once")] {
        let out = std::process::Command::new(&control.bin)
            .args(["schedule", "add", name, "--cron", "* * * * * *", "--overlap", "allow", "--catch-up", catch_up])
            .arg("--dir")
            .arg(&dir)
            .args(["--", "true"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
    let bin = control.bin.clone();
    let fires = |name: &str| -> Vec<String> {
        let out =
            std::process::Command::new(&bin).args(["schedule", "show", name, "--dir"]).arg(&dir).output().unwrap();
        lines_of(&out).into_iter().skip_while(|l| l != "recent fires").skip(1).collect()
    };
    common::wait_for("both schedules to fire", String::new, || {
        (fires("late-none").len() >= 2 && fires("late-once").len() >= 2).then_some(())
    });
    let before_once = fires("late-once").len();
    control.stop_and_count_connections();
    // The outage itself: three seconds with no ql-control, longer than
    // schedule_missed_after_ms.
    std::thread::sleep(std::time::Duration::from_secs(3));
    let control = common::Control::serve(&bin, &dir, "127.0.0.1:0", &err, &[]);
    common::wait_for("fires after the restart", String::new, || {
        let none_missed = fires("late-none").iter().any(|l| l.contains(" missed "));
        (none_missed && fires("late-once").len() > before_once.min(19)).then_some(())
    });
    let none = fires("late-none");
    let once = fires("late-once");
    assert!(none.iter().any(|l| l.contains(" missed ")), "catch-up none records the missed fire:\n{}", none.join("\n"));
    assert!(!once.iter().any(|l| l.contains(" missed ")), "catch-up once queues it:\n{}", once.join("\n"));
    // No burst: far fewer fires than seconds went by while it was down would make.
    let missed = none.iter().filter(|l| l.contains(" missed ")).count();
    assert_eq!(missed, 1, "one missed fire for the whole outage:\n{}", none.join("\n"));
    drop(control);
}
