//! The dashboard's HTML. Every value from the database — job output, labels, names,
//! errors — goes through [`e`] (text) or [`a`] (an attribute value), both
//! `html-escape`; nothing else is ever interpolated.

use std::borrow::Cow;

use crate::ops::local::label_list;
use crate::ops::view::{LogWindow, RunPage, RunView, ScheduleList, WorkerList};
use crate::ops::RunFilter;

/// Text content, escaped.
fn e(s: &str) -> Cow<'_, str> {
    html_escape::encode_text(s)
}

/// A double-quoted attribute value, escaped.
fn a(s: &str) -> Cow<'_, str> {
    html_escape::encode_double_quoted_attribute(s)
}

fn or_dash(s: Option<&str>) -> &str {
    s.unwrap_or("-")
}

/// Who is looking, and the CSRF token of their forms.
pub(super) struct Viewer<'a> {
    pub(super) name: &'a str,
    pub(super) admin: bool,
    pub(super) csrf: &'a str,
}

fn layout(title: &str, viewer: Option<&Viewer<'_>>, body: &str) -> String {
    let nav = match viewer {
        None => String::new(),
        Some(v) => format!(
            "<a href=\"/ui/runs\">Runs</a><a href=\"/ui/workers\">Workers</a><a href=\"/ui/schedules\">Schedules</a>\
             <span class=\"who\">{} ({})</span>\
             <form method=\"post\" action=\"/ui/logout\"><input type=\"hidden\" name=\"csrf\" value=\"{}\">\
             <button type=\"submit\">Sign out</button></form>",
            e(v.name),
            if v.admin { "admin" } else { "read" },
            a(v.csrf)
        ),
    };
    format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{} · QingLong Edge</title>\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <link rel=\"stylesheet\" href=\"/ui/static/app.css\"></head><body>\
         <header><strong>QingLong Edge</strong>{nav}</header><main><h1>{}</h1>{body}</main>\
         <script src=\"/ui/static/tail.js\"></script></body></html>",
        e(title),
        e(title)
    )
}

/// The sign-in page.
pub(super) fn login(refused: Option<&str>) -> String {
    let note = refused.map_or(String::new(), |m| format!("<p class=\"error\">{}</p>", e(m)));
    let body = format!(
        "{note}<form method=\"post\" action=\"/ui/login\"><label>Operator token \
         <input type=\"password\" name=\"token\" autocomplete=\"off\" required></label> \
         <button type=\"submit\">Sign in</button></form>\
         <p>Make one on the control machine: <code>ql-control operator add NAME --role read</code>.</p>"
    );
    layout("Sign in", None, &body)
}

/// An error, with nothing else.
pub(super) fn error(message: &str) -> String {
    layout("Not shown", None, &format!("<p class=\"error\">{}</p><p><a href=\"/ui/runs\">Runs</a></p>", e(message)))
}

fn status(s: &str) -> String {
    format!("<span class=\"status-{}\">{}</span>", a(s), e(s))
}

/// The runs, filtered, a page at a time.
pub(super) fn runs(v: &Viewer<'_>, filter: &RunFilter, page: &RunPage) -> String {
    let field = |name: &str, value: &Option<String>| {
        format!("<label>{name}<input name=\"{name}\" value=\"{}\"></label>", a(value.as_deref().unwrap_or("")))
    };
    let mut body = format!(
        "<form class=\"filters\" method=\"get\" action=\"/ui/runs\">{}{}{}<button type=\"submit\">Filter</button></form>",
        field("status", &filter.status),
        field("schedule", &filter.schedule),
        field("worker", &filter.worker)
    );
    body += "<table><thead><tr><th>Run</th><th>Status</th><th>Attempts</th><th>Created</th><th>Finished</th>\
             <th>Schedule</th><th>Error</th></tr></thead><tbody>";
    for r in &page.runs {
        body += &format!(
            "<tr><td><a href=\"/ui/runs/{}\">{}</a></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            a(&r.run_id),
            e(&r.run_id),
            status(&r.status),
            r.attempts,
            e(&r.created_at),
            e(or_dash(r.finished_at.as_deref())),
            e(or_dash(r.schedule.as_deref())),
            e(or_dash(r.error_code.as_deref()))
        );
    }
    body += "</tbody></table>";
    if let Some(next) = &page.next {
        let mut q =
            format!("before={}", percent_encoding::utf8_percent_encode(next, percent_encoding::NON_ALPHANUMERIC));
        for (k, val) in [("status", &filter.status), ("schedule", &filter.schedule), ("worker", &filter.worker)] {
            if let Some(val) = val {
                q +=
                    &format!("&{k}={}", percent_encoding::utf8_percent_encode(val, percent_encoding::NON_ALPHANUMERIC));
            }
        }
        body += &format!("<p><a rel=\"next\" href=\"/ui/runs?{}\">Older runs</a></p>", a(&q));
    }
    layout("Runs", Some(v), &body)
}

/// One run: its facts, attempts, events and log (live while it runs).
pub(super) fn run(v: &Viewer<'_>, r: &RunView, log: Option<&LogWindow>) -> String {
    let mut body = format!(
        "<dl><dt>Status</dt><dd>{}{}</dd><dt>Project</dt><dd>{}</dd><dt>Schedule</dt><dd>{}</dd>\
         <dt>Created</dt><dd>{}</dd><dt>Started</dt><dd>{}</dd><dt>Finished</dt><dd>{}</dd>\
         <dt>Labels</dt><dd>{} (trusted), {} (declared)</dd><dt>Summary</dt><dd>{}</dd></dl>",
        status(&r.status),
        r.error_code.as_ref().map_or(String::new(), |c| format!(" <span class=\"error\">{}</span>", e(c))),
        e(&r.project),
        e(or_dash(r.schedule.as_deref())),
        e(&r.created_at),
        e(or_dash(r.started_at.as_deref())),
        e(or_dash(r.finished_at.as_deref())),
        e(&label_list(&r.labels)),
        e(&label_list(&r.agent_labels)),
        e(or_dash(r.summary.as_deref()))
    );
    body += "<h2>Attempts</h2><table><thead><tr><th>#</th><th>Status</th><th>Worker</th><th>Exit</th>\
             <th>Signal</th><th>Error</th><th>Log</th></tr></thead><tbody>";
    for t in &r.attempts {
        let stored = t.artifact.as_ref().map_or_else(
            || format!("{} bytes live", t.log_acked),
            |x| format!("{} bytes, SHA-256 {}{}", x.length, x.sha256, if x.truncated { " (truncated)" } else { "" }),
        );
        body += &format!(
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            t.number,
            status(&t.status),
            e(&t.worker),
            t.exit_code.map_or("-".into(), |c| c.to_string()),
            t.signal.map_or("-".into(), |s| s.to_string()),
            e(or_dash(t.error_code.as_deref())),
            e(&stored)
        );
    }
    body += "</tbody></table>";
    if let Some(d) = &r.delivery {
        body += &format!(
            "<p>Webhook {} ({}): {} after {} attempt(s){}</p>",
            e(&d.origin),
            e(&d.on),
            e(&d.state),
            d.attempts,
            d.last_error.as_ref().map_or(String::new(), |x| format!(", last error: {}", e(x)))
        );
    }
    body += "<h2>Log</h2>";
    match log.filter(|w| w.attempt.is_some()) {
        None => body += "<p>No log yet.</p>",
        Some(w) => {
            let live = !w.terminal;
            body += &format!(
                "<p id=\"tail-state\">{}</p><pre class=\"log\" id=\"log\" data-live=\"{live}\" data-url=\"/ui/runs/{}/log\" \
                 data-attempt=\"{}\" data-offset=\"{}\">{}</pre>",
                if live { "the job is running: reload for more (or let the live tail follow it)" } else { "" },
                a(&r.run_id),
                a(w.attempt.as_deref().unwrap_or("")),
                w.offset + w.bytes.len() as u64,
                e(&String::from_utf8_lossy(&w.bytes))
            );
        }
    }
    body += "<h2>Events</h2><table><thead><tr><th>At</th><th>Event</th><th>From</th><th>To</th></tr></thead><tbody>";
    for ev in &r.events {
        body += &format!(
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            e(&ev.at),
            e(&ev.kind),
            e(or_dash(ev.from.as_deref())),
            e(or_dash(ev.to.as_deref()))
        );
    }
    body += "</tbody></table>";
    layout(&format!("Run {}", r.run_id), Some(v), &body)
}

/// The workers.
pub(super) fn workers(v: &Viewer<'_>, list: &WorkerList) -> String {
    let mut body = String::from(
        "<table><thead><tr><th>Worker</th><th>Session</th><th>Generation</th><th>State</th><th>Capacity</th>\
         <th>Last heartbeat</th><th>Agent</th><th>Access</th><th>Certificate not after</th><th>Trusted labels</th>\
         <th>Declared labels</th></tr></thead><tbody>",
    );
    for w in &list.workers {
        body += &format!(
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>\
             <td>{}</td><td>{}</td></tr>",
            e(&w.worker),
            e(or_dash(w.session.as_deref())),
            w.generation.map_or("-".into(), |g| g.to_string()),
            e(or_dash(w.status.as_deref())),
            w.capacity.map_or("-".into(), |c| c.to_string()),
            e(or_dash(w.last_seen.as_deref())),
            e(or_dash(w.agent.as_deref())),
            e(&w.access),
            e(or_dash(w.cert_not_after.as_deref())),
            e(&label_list(&w.labels)),
            e(&label_list(&w.declared))
        );
    }
    body += "</tbody></table>";
    if let Some(next) = &list.next {
        let q = format!("after={}", percent_encoding::utf8_percent_encode(next, percent_encoding::NON_ALPHANUMERIC));
        body += &format!("<p><a rel=\"next\" href=\"/ui/workers?{}\">More workers</a></p>", a(&q));
    }
    layout("Workers", Some(v), &body)
}

/// The schedules, with pause, resume and run-now for an admin.
pub(super) fn schedules(
    v: &Viewer<'_>,
    list: &ScheduleList,
    outcomes: &std::collections::BTreeMap<String, String>,
    done: Option<&str>,
) -> String {
    let mut body = done.map_or(String::new(), |m| format!("<p>{}</p>", e(m)));
    body += "<table><thead><tr><th>Name</th><th>Cron</th><th>Time zone</th><th>Overlap</th><th>Next fire</th>\
             <th>Last run</th><th>Its outcome</th><th></th></tr></thead><tbody>";
    for s in &list.schedules {
        let button = |action: &str, label: &str| {
            format!(
                "<form method=\"post\" action=\"/ui/schedules/{}/{action}\"><input type=\"hidden\" name=\"csrf\" \
                 value=\"{}\"><button type=\"submit\">{label}</button></form>",
                a(&s.name),
                a(v.csrf)
            )
        };
        let actions = if v.admin {
            let toggle = if s.paused { button("resume", "Resume") } else { button("pause", "Pause") };
            toggle + &button("run-now", "Run now")
        } else {
            String::new()
        };
        let last = s
            .last_run
            .as_deref()
            .map_or_else(|| "-".to_owned(), |r| format!("<a href=\"/ui/runs/{}\">{}</a>", a(r), e(r)));
        let outcome = s.last_run.as_ref().and_then(|r| outcomes.get(r)).map_or_else(|| "-".to_owned(), |x| status(x));
        body += &format!(
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{last}</td><td>{outcome}</td>\
             <td>{actions}</td></tr>",
            e(&s.name),
            e(&s.cron),
            e(&s.tz),
            e(&s.overlap),
            if s.paused { "paused".to_owned() } else { e(or_dash(s.next_fire.as_deref())).into_owned() }
        );
    }
    body += "</tbody></table>";
    layout("Schedules", Some(v), &body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::view::RunRow;

    #[test]
    fn every_value_on_a_page_is_escaped() {
        let evil = "<script>alert(1)</script>\"'&";
        let page = RunPage {
            runs: vec![RunRow {
                run_id: evil.into(),
                project: evil.into(),
                status: evil.into(),
                attempts: 1,
                created_at: evil.into(),
                finished_at: Some(evil.into()),
                schedule: Some(evil.into()),
                error_code: Some(evil.into()),
            }],
            next: Some(evil.into()),
        };
        let filter = RunFilter { status: Some(evil.into()), ..RunFilter::default() };
        let viewer = Viewer { name: evil, admin: true, csrf: evil };
        let html = runs(&viewer, &filter, &page);
        assert!(!html.contains("<script>alert"), "{html}");
        assert!(!html.contains("\"'&\""), "{html}");
        assert_eq!(html.matches("<script").count(), 1, "only the page's own script: {html}");
        assert!(error(evil).contains("&lt;script&gt;"));
        let list = WorkerList { workers: Vec::new(), next: Some(evil.into()) };
        let html = workers(&viewer, &list);
        assert!(!html.contains("<script>alert") && !html.contains("\"'&\""), "{html}");
        assert!(html.contains("href=\"/ui/workers?after=%3Cscript%3E"), "{html}");
    }
}
