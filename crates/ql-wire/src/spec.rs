//! The execution spec a claim delivers: what to run, with which environment and limits.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

use crate::fence::schema_tag;
use crate::ids::{check_chars, string_type, Invalid, ProjectId};
use crate::limits::{
    ARGV_MAX, ARG_MAX_BYTES, ENV_MAX, ENV_VALUE_MAX_BYTES, LOG_LIMIT_MAX, SCRIPT_MAX_BYTES, TIMEOUT_MAX_MS,
};

schema_tag!(
    /// `qinglong/execution-spec@v1`.
    SpecSchema = "qinglong/execution-spec@v1"
);

fn env_first(b: u8) -> bool {
    b.is_ascii_alphabetic() || b == b'_'
}

fn env_rest(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

string_type!(
    /// An environment variable name: `[A-Za-z_][A-Za-z0-9_]{0,127}`.
    EnvName,
    |s| check_chars(s, 128, env_first, env_rest).map_err(|e| if e == Invalid::Charset { Invalid::EnvName } else { e })
);

/// The interpreter a script runs under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Interpreter {
    /// POSIX shell.
    Sh,
    /// Python 3.
    Python3,
    /// Node.js.
    Node,
}

impl Interpreter {
    /// The program the agent runs.
    pub fn program(self) -> &'static str {
        match self {
            Self::Sh => "sh",
            Self::Python3 => "python3",
            Self::Node => "node",
        }
    }
}

/// A script and its interpreter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Script {
    /// Which interpreter runs it.
    pub interpreter: Interpreter,
    /// The source, at most 256 KiB.
    pub source: String,
}

/// `{schema, projectId, argv | script, env, timeoutMs, logLimitBytes}`.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ExecutionSpec {
    /// Always [`SpecSchema::TEXT`].
    pub schema: SpecSchema,
    /// The run's project.
    pub project_id: ProjectId,
    /// A program and its arguments; exclusive with `script`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub argv: Option<Vec<String>>,
    /// A script; exclusive with `argv`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub script: Option<Script>,
    /// Extra environment, at most 64 pairs.
    pub env: BTreeMap<EnvName, String>,
    /// Run time limit.
    pub timeout_ms: u64,
    /// Bytes of log kept; output beyond is dropped and the log marked truncated.
    pub log_limit_bytes: u64,
}

impl fmt::Debug for ExecutionSpec {
    // Environment values may hold the user's secrets: show names only.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExecutionSpec")
            .field("project_id", &self.project_id)
            .field("argv_len", &self.argv.as_ref().map(Vec::len))
            .field("script", &self.script.as_ref().map(|s| (s.interpreter, s.source.len())))
            .field("env", &self.env.keys().collect::<Vec<_>>())
            .field("timeout_ms", &self.timeout_ms)
            .field("log_limit_bytes", &self.log_limit_bytes)
            .finish()
    }
}

fn check_text(s: &str, max: usize) -> Result<(), Invalid> {
    if s.len() > max {
        return Err(Invalid::TooLong { max });
    }
    // A NUL cannot cross execve: refuse it rather than truncate silently.
    if s.contains('\0') {
        return Err(Invalid::NotPrintable);
    }
    Ok(())
}

impl ExecutionSpec {
    /// Checks every bound of the spec.
    pub fn validate(&self) -> Result<(), Invalid> {
        match (&self.argv, &self.script) {
            (Some(argv), None) => {
                if argv.is_empty() || argv.len() > ARGV_MAX {
                    return Err(Invalid::TooMany { max: ARGV_MAX });
                }
                if argv[0].is_empty() {
                    return Err(Invalid::Empty);
                }
                argv.iter().try_for_each(|a| check_text(a, ARG_MAX_BYTES))?;
            }
            (None, Some(script)) => check_text(&script.source, SCRIPT_MAX_BYTES)?,
            _ => return Err(Invalid::ArgvXorScript),
        }
        if self.env.len() > ENV_MAX {
            return Err(Invalid::TooMany { max: ENV_MAX });
        }
        self.env.values().try_for_each(|v| check_text(v, ENV_VALUE_MAX_BYTES))?;
        if !(1..=TIMEOUT_MAX_MS).contains(&self.timeout_ms) {
            return Err(Invalid::OutOfRange { min: 1, max: TIMEOUT_MAX_MS });
        }
        if self.log_limit_bytes > LOG_LIMIT_MAX {
            return Err(Invalid::OutOfRange { min: 0, max: LOG_LIMIT_MAX });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv_spec() -> ExecutionSpec {
        ExecutionSpec {
            schema: SpecSchema,
            project_id: ProjectId::parse("p1").unwrap(),
            argv: Some(vec!["echo".into(), "hi".into()]),
            script: None,
            env: BTreeMap::new(),
            timeout_ms: 1000,
            log_limit_bytes: 1024,
        }
    }

    #[test]
    fn a_plain_argv_spec_is_valid() {
        assert_eq!(argv_spec().validate(), Ok(()));
    }

    #[test]
    fn argv_bounds() {
        let mut s = argv_spec();
        s.argv = Some(vec![]);
        assert_eq!(s.validate(), Err(Invalid::TooMany { max: ARGV_MAX }));
        s.argv = Some(vec!["x".into(); ARGV_MAX + 1]);
        assert_eq!(s.validate(), Err(Invalid::TooMany { max: ARGV_MAX }));
        s.argv = Some(vec!["x".into(); ARGV_MAX]);
        assert_eq!(s.validate(), Ok(()));
        s.argv = Some(vec!["".into()]);
        assert_eq!(s.validate(), Err(Invalid::Empty));
        s.argv = Some(vec!["a".into(), "b\0c".into()]);
        assert_eq!(s.validate(), Err(Invalid::NotPrintable));
        s.argv = Some(vec!["a".into(), "b".repeat(ARG_MAX_BYTES + 1)]);
        assert_eq!(s.validate(), Err(Invalid::TooLong { max: ARG_MAX_BYTES }));
    }

    #[test]
    fn exactly_one_of_argv_and_script() {
        let mut s = argv_spec();
        s.script = Some(Script { interpreter: Interpreter::Sh, source: "true".into() });
        assert_eq!(s.validate(), Err(Invalid::ArgvXorScript));
        s.argv = None;
        assert_eq!(s.validate(), Ok(()));
        s.script = None;
        assert_eq!(s.validate(), Err(Invalid::ArgvXorScript));
    }

    #[test]
    fn script_source_is_capped_at_256_kib() {
        let mut s = argv_spec();
        s.argv = None;
        s.script = Some(Script { interpreter: Interpreter::Python3, source: "#".repeat(SCRIPT_MAX_BYTES) });
        assert_eq!(s.validate(), Ok(()));
        s.script = Some(Script { interpreter: Interpreter::Node, source: "#".repeat(SCRIPT_MAX_BYTES + 1) });
        assert_eq!(s.validate(), Err(Invalid::TooLong { max: SCRIPT_MAX_BYTES }));
    }

    #[test]
    fn env_bounds() {
        let mut s = argv_spec();
        for i in 0..ENV_MAX {
            s.env.insert(EnvName::parse(format!("V{i}")).unwrap(), "x".into());
        }
        assert_eq!(s.validate(), Ok(()));
        s.env.insert(EnvName::parse("ONE_MORE").unwrap(), "x".into());
        assert_eq!(s.validate(), Err(Invalid::TooMany { max: ENV_MAX }));
        let mut s = argv_spec();
        s.env.insert(EnvName::parse("BIG").unwrap(), "x".repeat(ENV_VALUE_MAX_BYTES + 1));
        assert_eq!(s.validate(), Err(Invalid::TooLong { max: ENV_VALUE_MAX_BYTES }));
        assert_eq!(EnvName::parse("1ABC"), Err(Invalid::EnvName));
        assert_eq!(EnvName::parse("A=B"), Err(Invalid::EnvName));
        assert_eq!(EnvName::parse(""), Err(Invalid::Empty));
    }

    #[test]
    fn timeout_and_log_limit_ranges() {
        let mut s = argv_spec();
        s.timeout_ms = 0;
        assert_eq!(s.validate(), Err(Invalid::OutOfRange { min: 1, max: TIMEOUT_MAX_MS }));
        s.timeout_ms = TIMEOUT_MAX_MS + 1;
        assert!(s.validate().is_err());
        s.timeout_ms = 1;
        s.log_limit_bytes = LOG_LIMIT_MAX + 1;
        assert_eq!(s.validate(), Err(Invalid::OutOfRange { min: 0, max: LOG_LIMIT_MAX }));
        s.log_limit_bytes = LOG_LIMIT_MAX;
        assert_eq!(s.validate(), Ok(()));
    }

    #[test]
    fn debug_hides_env_values_and_script_source() {
        let mut s = argv_spec();
        s.env.insert(EnvName::parse("API_KEY").unwrap(), "hunter2".into());
        let shown = format!("{s:?}");
        assert!(shown.contains("API_KEY"));
        assert!(!shown.contains("hunter2"));
    }
}
