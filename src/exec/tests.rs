//! Real child processes writing real files. Nothing here sleeps to synchronise: tests wait
//! for a condition, copying the job's output meanwhile, and fail at a deadline.

use super::*;
use ql_wire::spec::{EnvName, Script, SpecSchema};
use std::collections::BTreeMap;
use std::future::Future;
use std::os::unix::fs::PermissionsExt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

const POLL: Duration = Duration::from_millis(5);
const DEADLINE: Duration = Duration::from_secs(30);
const GRACE: Duration = Duration::from_secs(10);

/// A private directory under the system temp dir, removed on drop.
struct TestDir(PathBuf);

impl TestDir {
    fn new(tag: &str) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("ql-agent-exec-{}-{n}-{tag}", std::process::id()));
        let _ = fs::remove_dir_all(&path);
        fs::create_dir_all(&path).unwrap();
        Self(path)
    }

    fn run_dir(&self) -> RunDir {
        RunDir::new(&self.0, &AttemptId::parse("attempt-1").unwrap())
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// Runs `f` on a single-threaded executor that also drives async-process, as the agent will.
fn block_on<T>(f: impl Future<Output = T>) -> T {
    let ex = smol::LocalExecutor::new();
    ex.spawn(smol::process::driver()).detach();
    smol::block_on(ex.run(f))
}

fn spec_with(argv: Option<&[&str]>, script: Option<Script>) -> ExecutionSpec {
    ExecutionSpec {
        schema: SpecSchema,
        project_id: "p1".parse().unwrap(),
        argv: argv.map(|a| a.iter().map(|s| s.to_string()).collect()),
        script,
        env: BTreeMap::new(),
        timeout_ms: 60_000,
        log_limit_bytes: 1 << 20,
    }
}

fn argv(args: &[&str]) -> ExecutionSpec {
    spec_with(Some(args), None)
}

fn script(interpreter: Interpreter, source: &str) -> ExecutionSpec {
    spec_with(None, Some(Script { interpreter, source: source.to_owned() }))
}

fn spawn(dir: &TestDir, spec: &ExecutionSpec) -> Job {
    Job::spawn(spec, dir.run_dir(), POLL).unwrap_or_else(|e| panic!("spawn failed: {e}"))
}

fn spool(job: &Job) -> String {
    fs::read_to_string(&job.run_dir().spool).unwrap()
}

fn mode(path: &Path) -> u32 {
    fs::metadata(path).unwrap().permissions().mode() & 0o777
}

/// Pids of the group's live members.
fn live_members(pgid: u32) -> Vec<u32> {
    fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| group::read_stat(pid).is_ok_and(|s| s.pgrp == pgid as i32 && s.is_live()))
        .collect()
}

/// Copies the job's output until `cond` holds; fails after [`DEADLINE`].
async fn until(job: &mut Job, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + DEADLINE;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        future::or(
            async {
                job.wait().await.unwrap();
            },
            async {
                Timer::after(POLL).await;
            },
        )
        .await;
    }
}

#[test]
fn an_argv_job_that_exits_zero_keeps_its_output() {
    let dir = TestDir::new("exit-0");
    block_on(async {
        let mut job = spawn(&dir, &argv(&["echo", "hello"]));
        let exit = job.wait().await.unwrap();
        assert_eq!(exit, Exit { code: Some(0), signal: None, truncated: false, log_len: 6 });
        assert_eq!(spool(&job), "hello\n");
    });
}

#[test]
fn an_argv_job_that_exits_three_reports_three() {
    let dir = TestDir::new("exit-3");
    block_on(async {
        let mut job = spawn(&dir, &argv(&["sh", "-c", "exit 3"]));
        let exit = job.wait().await.unwrap();
        assert_eq!((exit.code, exit.signal), (Some(3), None));
    });
}

#[test]
fn a_job_ended_by_a_signal_reports_the_signal() {
    let dir = TestDir::new("signalled");
    block_on(async {
        let mut job = spawn(&dir, &argv(&["sh", "-c", "kill -9 $$"]));
        let exit = job.wait().await.unwrap();
        assert_eq!((exit.code, exit.signal), (None, Some(9)));
    });
}

#[test]
fn an_sh_script_runs_from_its_file_with_stdout_and_stderr_in_one_spool() {
    let dir = TestDir::new("sh");
    block_on(async {
        let source = "echo out\necho err >&2\necho \"$0\"\nexit 5\n";
        let mut job = spawn(&dir, &script(Interpreter::Sh, source));
        let exit = job.wait().await.unwrap();
        assert_eq!(exit.code, Some(5));
        let path = job.run_dir().script(Interpreter::Sh);
        assert_eq!(spool(&job), format!("out\nerr\n{}\n", path.display()));
        assert_eq!(fs::read_to_string(&path).unwrap(), source);
        assert_eq!(mode(&path), 0o600);
        assert!(!path.starts_with(&job.run_dir().work), "the job must not be able to clobber its script");
    });
}

#[test]
fn a_python3_script_runs_under_python3() {
    let dir = TestDir::new("python3");
    block_on(async {
        let source = "import sys\nprint('from python', sys.version_info[0])\nsys.stdout.flush()\nsys.exit(7)\n";
        let mut job = spawn(&dir, &script(Interpreter::Python3, source));
        let exit = job.wait().await.unwrap();
        assert_eq!(spool(&job), "from python 3\n");
        assert_eq!(exit.code, Some(7));
        assert!(job.run_dir().script(Interpreter::Python3).ends_with("script.py"));
    });
}

#[test]
fn a_missing_program_is_a_clear_spawn_error() {
    let dir = TestDir::new("missing");
    for program in ["ql-no-such-program", "/nonexistent/bin/tool"] {
        match Job::spawn(&argv(&[program, "--secret-arg"]), dir.run_dir(), POLL) {
            Err(SpawnError::Program { program: p, error }) => {
                assert_eq!(p, program);
                assert_eq!(error.kind(), io::ErrorKind::NotFound);
                let shown = SpawnError::Program { program: p, error }.to_string();
                assert!(shown.starts_with(&format!("cannot start `{program}`: ")), "{shown}");
                assert!(!shown.contains("secret"), "{shown}");
            }
            other => panic!("{program}: {other:?}"),
        }
    }
}

#[test]
fn a_program_that_is_not_executable_is_a_spawn_error() {
    let dir = TestDir::new("not-executable");
    let file = dir.0.join("data.txt");
    fs::write(&file, "not a program").unwrap();
    fs::set_permissions(&file, fs::Permissions::from_mode(0o644)).unwrap();
    match Job::spawn(&argv(&[file.to_str().unwrap()]), dir.run_dir(), POLL) {
        Err(SpawnError::Program { error, .. }) => assert_eq!(error.kind(), io::ErrorKind::PermissionDenied),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_spec_with_nothing_to_run_is_refused() {
    let dir = TestDir::new("nothing");
    assert!(matches!(Job::spawn(&spec_with(None, None), dir.run_dir(), POLL), Err(SpawnError::NothingToRun)));
    assert!(matches!(Job::spawn(&spec_with(Some(&[]), None), dir.run_dir(), POLL), Err(SpawnError::NothingToRun)));
}

#[test]
fn output_past_the_limit_is_cut_exactly_there_and_the_job_still_finishes() {
    let dir = TestDir::new("limit");
    block_on(async {
        // 300 000 bytes: far more than the pipe holds, so the job only ends if the agent
        // keeps draining after the limit.
        let mut spec = argv(&["sh", "-c", "yes abcdefghi | head -c 300000"]);
        spec.log_limit_bytes = 1000;
        let mut job = spawn(&dir, &spec);
        let exit = job.wait().await.unwrap();
        assert_eq!(exit, Exit { code: Some(0), signal: None, truncated: true, log_len: 1000 });
        assert_eq!(spool(&job), "abcdefghi\n".repeat(100));
    });
}

#[test]
fn output_exactly_at_the_limit_is_not_truncated() {
    let dir = TestDir::new("at-limit");
    block_on(async {
        for (limit, text, truncated) in
            [(10, "0123456789", false), (0, "x", true), (0, "", false), (11, "0123456789", false)]
        {
            let mut spec = argv(&["printf", "%s", text]);
            spec.log_limit_bytes = limit;
            let mut job = spawn(&dir, &spec);
            let exit = job.wait().await.unwrap();
            let kept = text.len().min(limit as usize);
            assert_eq!((exit.truncated, exit.log_len), (truncated, kept as u64), "limit {limit}, {text:?}");
            assert_eq!(spool(&job), &text[..kept]);
        }
    });
}

#[test]
fn output_survives_waits_that_are_dropped_midway() {
    let dir = TestDir::new("cancel");
    block_on(async {
        let mut job =
            spawn(&dir, &argv(&["sh", "-c", "i=0; while [ $i -lt 3000 ]; do echo line-$i; i=$((i+1)); done"]));
        let mut exit = None;
        let deadline = Instant::now() + DEADLINE;
        while exit.is_none() {
            assert!(Instant::now() < deadline, "the job did not finish");
            exit = future::or(async { Some(job.wait().await.unwrap()) }, async {
                Timer::after(Duration::from_micros(200)).await;
                None
            })
            .await;
        }
        let expected: String = (0..3000).map(|i| format!("line-{i}\n")).collect();
        assert_eq!(spool(&job), expected);
        assert_eq!(exit.unwrap().log_len, expected.len() as u64);
    });
}

#[test]
fn stop_ends_the_whole_group_including_a_background_grandchild() {
    let dir = TestDir::new("grandchild");
    block_on(async {
        let mut job = spawn(&dir, &argv(&["sh", "-c", "sleep 1000 & sleep 1000"]));
        let pgid = job.pgid();
        until(&mut job, "the background sleep", || live_members(pgid).len() >= 2).await;
        assert!(is_alive(job.executor_handle()));
        let exit = job.stop(GRACE).await.unwrap();
        assert_eq!(exit.signal, Some(15), "{exit:?}");
        assert_eq!(live_members(pgid), Vec::<u32>::new());
        assert!(!group_alive(pgid).unwrap());
        assert!(!is_alive(job.executor_handle()));
    });
}

#[test]
fn a_job_that_ignores_term_is_killed_after_the_grace() {
    let dir = TestDir::new("trap");
    block_on(async {
        let mut spec = argv(&["sh", "-c", "trap '' TERM; echo ready; sleep 1000 & while :; do sleep 1000; done"]);
        spec.timeout_ms = 100;
        let mut job = spawn(&dir, &spec);
        let spool_path = job.run_dir().spool.clone();
        until(&mut job, "the trap", || fs::read_to_string(&spool_path).unwrap().contains("ready")).await;
        // The agent's timeout: the run's limit raced against the exit.
        let timeout = Duration::from_millis(spec.timeout_ms);
        let timed_out = future::or(
            async {
                job.wait().await.unwrap();
                false
            },
            async {
                Timer::after(timeout).await;
                true
            },
        )
        .await;
        assert!(timed_out);
        let grace = Duration::from_millis(300);
        let started = Instant::now();
        let exit = job.stop(grace).await.unwrap();
        assert!(started.elapsed() >= grace, "KILL came before the grace ran out");
        assert_eq!(exit.signal, Some(9), "{exit:?}");
        assert!(!group_alive(job.pgid()).unwrap());
        assert_eq!(spool(&job), "ready\n");
    });
}

#[test]
fn stop_after_wait_returns_the_same_exit_at_once() {
    let dir = TestDir::new("stop-after-wait");
    block_on(async {
        let mut job = spawn(&dir, &argv(&["true"]));
        let exit = job.wait().await.unwrap();
        assert_eq!(job.wait().await.unwrap(), exit);
        // At once: ready on its first poll, not after its grace.
        let stopped = smol::future::poll_once(job.stop(Duration::from_secs(600))).await;
        assert_eq!(stopped.expect("stop answers at once").unwrap(), exit);
    });
}

#[test]
fn stop_after_wait_ends_members_that_closed_their_output() {
    let dir = TestDir::new("leftover");
    block_on(async {
        let mut job = spawn(&dir, &argv(&["sh", "-c", "sleep 1000 >/dev/null 2>&1 & echo started"]));
        let exit = job.wait().await.unwrap();
        assert_eq!(exit.code, Some(0));
        assert_eq!(spool(&job), "started\n");
        assert!(group_alive(job.pgid()).unwrap(), "the background sleep outlives the leader");
        assert_eq!(job.stop(GRACE).await.unwrap(), exit, "the leader's exit stands");
        assert!(!group_alive(job.pgid()).unwrap());
    });
}

#[test]
fn stop_orphan_ends_a_group_found_by_its_handle() {
    let dir = TestDir::new("orphan");
    block_on(async {
        let mut job = spawn(&dir, &argv(&["sh", "-c", "sleep 1000 & sleep 1000"]));
        let pgid = job.pgid();
        until(&mut job, "the background sleep", || live_members(pgid).len() >= 2).await;
        let handle = job.executor_handle().clone();
        assert!(stop_orphan(&handle, GRACE, POLL).await.unwrap());
        assert!(!group_alive(pgid).unwrap());
        assert_eq!(job.wait().await.unwrap().signal, Some(15));
        // The leader is reaped now: its pid may be reused, so the handle no longer acts.
        assert!(!is_alive(&handle));
        assert!(!stop_orphan(&handle, GRACE, POLL).await.unwrap());
    });
}

#[test]
fn the_spec_env_is_added_to_a_minimal_inherited_env() {
    let dir = TestDir::new("env");
    block_on(async {
        let mut spec = argv(&["env"]);
        spec.env.insert(EnvName::parse("QL_TEST_GREETING").unwrap(), "hello world = 1".to_owned());
        spec.env.insert(EnvName::parse("HOME").unwrap(), "/spec/home".to_owned());
        let mut job = spawn(&dir, &spec);
        assert_eq!(job.wait().await.unwrap().code, Some(0));
        let out = spool(&job);
        let vars: BTreeMap<&str, &str> = out.lines().filter_map(|l| l.split_once('=')).collect();
        assert_eq!(vars.get("QL_TEST_GREETING"), Some(&"hello world = 1"));
        assert_eq!(vars.get("HOME"), Some(&"/spec/home"), "the spec overrides what is inherited");
        assert!(vars.contains_key("PATH"));
        assert_eq!(vars.get(ATTEMPT_VAR), Some(&"attempt-1"), "every job carries its attempt id");
        for name in vars.keys() {
            let ours = INHERITED_ENV.contains(name) || [ATTEMPT_VAR, "QL_TEST_GREETING"].contains(name);
            assert!(ours, "{name} leaked into the job");
        }
    });
}

#[test]
fn the_job_runs_in_its_own_work_dir_and_the_run_dir_is_private() {
    let dir = TestDir::new("cwd");
    block_on(async {
        let mut job = spawn(&dir, &argv(&["pwd"]));
        assert_eq!(job.wait().await.unwrap().code, Some(0));
        let run = job.run_dir().clone();
        assert_eq!(spool(&job).trim_end(), fs::canonicalize(&run.work).unwrap().to_str().unwrap());
        assert_eq!(run.root, dir.0.join("runs").join("attempt-1"));
        assert_eq!(mode(&run.root), 0o700);
        assert_eq!(mode(&run.spool), 0o600);
        run.remove().unwrap();
        assert!(!run.root.exists());
        run.remove().unwrap();
    });
}

#[test]
fn the_executor_handle_names_the_live_leader() {
    let dir = TestDir::new("handle");
    block_on(async {
        let mut job = spawn(&dir, &argv(&["sleep", "1000"]));
        let handle = job.executor_handle().clone();
        assert!(handle.as_str().starts_with(&format!("pid:{} start:", job.pid())), "{handle}");
        assert!(is_alive(&handle));
        job.stop(GRACE).await.unwrap();
        assert!(!is_alive(&handle));
    });
}

/// A run directory whose attempt id no other test uses: the marker is global to the host.
fn unique_run_dir(dir: &TestDir, tag: &str) -> RunDir {
    RunDir::new(&dir.0, &AttemptId::parse(format!("att-{tag}-{}", std::process::id())).unwrap())
}

#[test]
fn an_unrecorded_job_is_found_by_the_attempt_id_in_its_environment() {
    let dir = TestDir::new("unrecorded");
    block_on(async {
        let run_dir = unique_run_dir(&dir, "unrecorded");
        let attempt = run_dir.attempt.to_string();
        assert_eq!(find_unrecorded(&attempt, GRACE, POLL).await.unwrap(), Found::Nothing);
        let spec = argv(&["sh", "-c", "sleep 1000 & sleep 1000"]);
        let mut job = Job::spawn(&spec, run_dir, POLL).unwrap();
        let pgid = job.pgid();
        until(&mut job, "the background sleep", || live_members(pgid).len() >= 2).await;
        let found = find_unrecorded(&attempt, GRACE, POLL).await.unwrap();
        assert_eq!(found, Found::Leader { handle: job.executor_handle().clone(), pid: job.pid() });
        assert!(live_members(pgid).len() >= 2, "a leader found is left for the caller to adopt");
        assert!(stop_orphan(job.executor_handle(), GRACE, POLL).await.unwrap());
        assert_eq!(job.wait().await.unwrap().signal, Some(15));
        assert_eq!(find_unrecorded(&attempt, GRACE, POLL).await.unwrap(), Found::Nothing);
    });
}

#[test]
fn members_left_without_their_leader_are_stopped() {
    let dir = TestDir::new("leaderless");
    block_on(async {
        let run_dir = unique_run_dir(&dir, "leaderless");
        let attempt = run_dir.attempt.to_string();
        let spec = argv(&["sh", "-c", "sleep 1000 >/dev/null 2>&1 & echo started"]);
        let mut job = Job::spawn(&spec, run_dir.clone(), POLL).unwrap();
        let pgid = job.pgid();
        assert_eq!(job.wait().await.unwrap().code, Some(0));
        assert!(group_alive(pgid).unwrap(), "the background sleep outlives the leader");
        // As after a restart: the recorded group's leader is gone, a member is left.
        assert!(!stop_leftovers("some-other-attempt", pgid, GRACE, POLL).await.unwrap());
        assert!(stop_leftovers(&attempt, pgid, GRACE, POLL).await.unwrap());
        assert!(!group_alive(pgid).unwrap());
        assert!(!stop_leftovers(&attempt, pgid, GRACE, POLL).await.unwrap());
        // And when nothing was recorded at all.
        let mut again = Job::spawn(&spec, run_dir, POLL).unwrap();
        assert_eq!(again.wait().await.unwrap().code, Some(0));
        assert!(group_alive(again.pgid()).unwrap());
        assert_eq!(find_unrecorded(&attempt, GRACE, POLL).await.unwrap(), Found::Stopped);
        assert!(!group_alive(again.pgid()).unwrap());
    });
}

#[test]
fn run_directories_no_job_names_are_removed_and_nothing_else() {
    let dir = TestDir::new("strays");
    let attempt = |s: &str| AttemptId::parse(s).unwrap();
    for a in ["att_kept", "att_dropped"] {
        let run = RunDir::new(&dir.0, &attempt(a));
        fs::create_dir_all(&run.work).unwrap();
        fs::write(&run.spool, b"log").unwrap();
    }
    // Not the agent's: a file, and a directory whose name is no attempt id.
    fs::write(dir.0.join("runs").join("att_file"), b"x").unwrap();
    fs::create_dir_all(dir.0.join("runs").join("not an attempt")).unwrap();
    assert_eq!(remove_strays(&dir.0, |a| a == "att_kept").unwrap(), 1);
    assert!(RunDir::new(&dir.0, &attempt("att_kept")).spool.exists());
    assert!(!RunDir::new(&dir.0, &attempt("att_dropped")).root.exists());
    assert!(dir.0.join("runs").join("att_file").exists() && dir.0.join("runs").join("not an attempt").exists());
    assert_eq!(remove_strays(&dir.0, |_| false).unwrap(), 1, "only the kept one was left");
    assert_eq!(remove_strays(&dir.0.join("nowhere"), |_| false).unwrap(), 0, "no runs directory");
}
