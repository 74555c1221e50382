//! The operator commands' answers as text for people: tables and one run's story. The
//! same text whether the answer came from the local store or a remote `serve`.

use super::local::label_list;
use super::view::{CertificateList, RunPage, RunView, ScheduleList, ScheduleRow, ScheduleView, WorkerList};

fn or_dash(s: Option<&str>) -> &str {
    s.unwrap_or("-")
}

/// The runs as a table.
pub fn runs(page: &RunPage) -> String {
    let line = |c: [&str; 7]| {
        format!("{:<28} {:<11} {:>8} {:<24} {:<24} {:<16} {}\n", c[0], c[1], c[2], c[3], c[4], c[5], c[6])
    };
    let mut out = line(["RUN", "STATUS", "ATTEMPTS", "CREATED", "FINISHED", "SCHEDULE", "ERROR"]);
    for r in &page.runs {
        out += &line([
            &r.run_id,
            &r.status,
            &r.attempts.to_string(),
            &r.created_at,
            or_dash(r.finished_at.as_deref()),
            or_dash(r.schedule.as_deref()),
            or_dash(r.error_code.as_deref()),
        ]);
    }
    if let Some(next) = &page.next {
        out += &format!("(more: --before {next})\n");
    }
    out
}

/// The workers as a table, with each worker's trusted labels (the operator's) beside the
/// labels its agent declared, and how many times in the last hour another agent with the
/// same identity was refused a session (a twin).
pub fn workers(list: &WorkerList) -> String {
    let line = |c: [&str; 12]| {
        format!(
            "{:<24} {:<28} {:>4} {:<9} {:>8} {:<24} {:<20} {:>5} {:<8} {:<24} {:<24} {}\n",
            c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7], c[8], c[9], c[10], c[11]
        )
    };
    let mut out = line([
        "WORKER",
        "SESSION",
        "GEN",
        "STATUS",
        "CAPACITY",
        "LAST SEEN",
        "AGENT",
        "TWINS",
        "ACCESS",
        "CERT NOT AFTER",
        "TRUSTED LABELS",
        "DECLARED",
    ]);
    let num = |n: Option<u64>| n.map_or_else(|| "-".to_owned(), |n| n.to_string());
    for w in &list.workers {
        let quiet = w.session.is_none();
        out += &line([
            &w.worker,
            or_dash(w.session.as_deref()),
            &num(w.generation),
            or_dash(w.status.as_deref()),
            &num(w.capacity.map(u64::from)),
            or_dash(w.last_seen.as_deref()),
            or_dash(w.agent.as_deref()),
            &if quiet { "-".to_owned() } else { w.twins.to_string() },
            &w.access,
            or_dash(w.cert_not_after.as_deref()),
            &label_list(&w.labels),
            &if quiet { "-".to_owned() } else { label_list(&w.declared) },
        ]);
    }
    if list.workers.iter().any(|w| w.twins > 0) {
        out += "TWINS: session opens refused in the last hour because another agent with the same worker id \
                held the session: two ql-agents share one certificate\n";
    }
    if let Some(next) = &list.next {
        out += &format!("(more: --after {next})\n");
    }
    out
}

/// The recorded certificates, one line each.
pub fn certificates(list: &CertificateList) -> String {
    let line = |c: [&str; 6]| format!("{:<24} {:<34} {:<24} {:<24} {:<24} {}\n", c[0], c[1], c[2], c[3], c[4], c[5]);
    let mut out = line(["WORKER", "SERIAL", "ISSUED", "NOT AFTER", "REVOKED", "RENEWED FROM"]);
    for c in &list.certificates {
        let (revoked, from) = (or_dash(c.revoked_at.as_deref()), or_dash(c.renewed_from.as_deref()));
        out += &line([&c.worker, &c.serial, &c.issued_at, &c.not_after, revoked, from]);
    }
    if let Some(next) = &list.next {
        out += &format!("(more: --after {next})\n");
    }
    out
}

fn schedule_line(s: &ScheduleRow) -> String {
    format!(
        "{:<20} {:<20} {:<16} {:<8} {:<6} {:<24} {}",
        s.name,
        s.cron,
        s.tz,
        s.overlap,
        if s.paused { "yes" } else { "no" },
        or_dash(s.next_fire.as_deref()),
        or_dash(s.last_run.as_deref())
    )
}

fn schedule_header() -> String {
    format!("{:<20} {:<20} {:<16} {:<8} {:<6} {:<24} {}", "NAME", "CRON", "TZ", "OVERLAP", "PAUSED", "NEXT", "LAST RUN")
}

/// The schedules as a table.
pub fn schedules(list: &ScheduleList) -> String {
    let mut out = schedule_header() + "\n";
    for s in &list.schedules {
        out += &(schedule_line(s) + "\n");
    }
    out
}

/// One schedule with its recent fires.
pub fn schedule(view: &ScheduleView) -> String {
    let s = &view.schedule;
    let mut out = format!(
        "{}\n{}\ncatch-up {}, random delay {} ms, project {}, retries {}\nrecent fires\n",
        schedule_header(),
        schedule_line(s),
        s.catch_up,
        s.random_delay_ms,
        s.project,
        s.retries
    );
    for f in &view.fires {
        out += &format!("  {:<24} {:<8} {}\n", f.fire_at, f.outcome, or_dash(f.run_id.as_deref()));
    }
    out
}

/// One run for people.
pub fn run(r: &RunView) -> String {
    let mut out = format!(
        "run      {}\nproject  {}\nstatus   {}{}\ncreated  {}\nstarted  {}\nfinished {}\n",
        r.run_id,
        r.project,
        r.status,
        r.error_code.as_ref().map_or(String::new(), |c| format!(" ({c})")),
        r.created_at,
        or_dash(r.started_at.as_deref()),
        or_dash(r.finished_at.as_deref()),
    );
    if let Some(schedule) = &r.schedule {
        out += &format!("schedule {schedule}\n");
    }
    if let Some(stop) = r.stop {
        out += &format!("stop     {stop:?}\n");
    }
    if !r.labels.is_empty() || !r.agent_labels.is_empty() {
        out += &format!("labels   {} (trusted), {} (declared)\n", label_list(&r.labels), label_list(&r.agent_labels));
    }
    for a in &r.attempts {
        out += &format!(
            "attempt  {} #{} {} on {} exit={} signal={}{}\n",
            a.attempt_id,
            a.number,
            a.status,
            a.worker,
            a.exit_code.map_or("-".into(), |c| c.to_string()),
            a.signal.map_or("-".into(), |s| s.to_string()),
            a.artifact.as_ref().map_or(String::new(), |r| format!(
                " log={}B{}",
                r.length,
                if r.truncated { " (truncated)" } else { "" }
            )),
        );
    }
    if let Some(d) = &r.delivery {
        out += &format!(
            "webhook  {} ({}) {} after {} attempt(s){}\n",
            d.origin,
            d.on,
            d.state,
            d.attempts,
            d.last_error.as_ref().map_or(String::new(), |e| format!(", last error: {e}"))
        );
    }
    out += "events\n";
    for e in &r.events {
        out += &format!("  {} {:<22} {} -> {}\n", e.at, e.kind, or_dash(e.from.as_deref()), or_dash(e.to.as_deref()));
    }
    out
}
