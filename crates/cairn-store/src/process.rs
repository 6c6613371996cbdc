//! Host processes told apart by start time, and the writers of temporaries.
//!
//! A pid alone does not name a process: the kernel reuses pids, so a
//! process is its pid and its start time (field 22 of `/proc/PID/stat`).
//!
//! Every temporary Cairn leaves in a shared directory while it writes (a
//! chunk store `.partial` file, a layer directory being built, imported,
//! materialised or removed, a scratch directory) carries its writer in its
//! name as one field `<pid>+<start time>`, between `-` or `.` separators.
//! A sweeper removes such a temporary only when its writer is dead: no
//! process has that pid, or the one that has it started at another time.
//! A temporary whose name carries no writer (one written by an older Cairn)
//! is removed only once it is older than [`UNIDENTIFIED_GRACE`].

use std::fmt;
use std::sync::OnceLock;
use std::time::{Duration, SystemTime};

/// The process's start time (field 22 of `/proc/PID/stat`), in clock ticks.
pub fn pid_start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces and parentheses: skip past the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// True when `pid` runs and is the process that started at `start_time`
/// (and is not a zombie).
pub fn process_alive(pid: i32, start_time: u64) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let Some(close) = stat.rfind(')') else {
        return false;
    };
    let mut fields = stat[close + 2..].split_whitespace();
    let state = fields.next();
    if state == Some("Z") || state == Some("X") {
        return false;
    }
    fields.nth(18).and_then(|s| s.parse::<u64>().ok()) == Some(start_time)
}

/// How old a temporary whose name names no writer must be before it is
/// swept. Such names come from Cairn versions before writers were named;
/// an hour is far longer than any write of theirs that could still be
/// running beside this version.
pub const UNIDENTIFIED_GRACE: Duration = Duration::from_secs(3600);

/// The process writing a temporary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriterId {
    pub pid: i32,
    pub start_time: u64,
}

impl WriterId {
    /// This process.
    pub fn current() -> WriterId {
        static CURRENT: OnceLock<WriterId> = OnceLock::new();
        let pid = std::process::id() as i32;
        let of = |pid| WriterId {
            pid,
            // /proc is mounted wherever Cairn runs; without it no writer
            // could be told alive, this one included.
            start_time: pid_start_time(pid).unwrap_or(0),
        };
        let cached = *CURRENT.get_or_init(|| of(pid));
        // A forked child is another writer.
        if cached.pid == pid {
            cached
        } else {
            of(pid)
        }
    }

    /// Whether the writer still runs.
    pub fn is_running(&self) -> bool {
        process_alive(self.pid, self.start_time)
    }

    /// The writer a temporary's name carries: its first field, between
    /// `-` or `.` separators, of the form `<pid>+<start time>`.
    pub fn in_name(name: &str) -> Option<WriterId> {
        name.split(['-', '.']).find_map(|field| {
            let (pid, start) = field.split_once('+')?;
            let all_digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
            if !all_digits(pid) || !all_digits(start) {
                return None;
            }
            Some(WriterId {
                pid: pid.parse().ok()?,
                start_time: start.parse().ok()?,
            })
        })
    }
}

/// `<pid>+<start time>`, the field temporaries' names carry.
impl fmt::Display for WriterId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}+{}", self.pid, self.start_time)
    }
}

/// Whether the temporary `name`, last modified at `modified`, may be swept:
/// its writer is dead, or its name names none and it is older than
/// [`UNIDENTIFIED_GRACE`] (a modification time in the future, after a
/// clock step, keeps it).
pub fn is_abandoned(name: &str, modified: SystemTime) -> bool {
    match WriterId::in_name(name) {
        Some(writer) => !writer.is_running(),
        None => SystemTime::now()
            .duration_since(modified)
            .is_ok_and(|age| age >= UNIDENTIFIED_GRACE),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_alive_and_a_wrong_start_time_is_not() {
        let pid = std::process::id() as i32;
        let start = pid_start_time(pid).expect("own stat");
        assert!(process_alive(pid, start));
        assert!(!process_alive(pid, start + 1));
        assert!(!process_alive(i32::MAX, start));
        assert_eq!(WriterId::current(), WriterId { pid, start_time: start });
        assert!(WriterId::current().is_running());
    }

    #[test]
    fn a_writer_is_read_back_from_any_field_of_a_name() {
        let w = WriterId {
            pid: 4242,
            start_time: 987654,
        };
        assert_eq!(w.to_string(), "4242+987654");
        for name in [
            format!("{w}-3-1700000000.partial"),
            format!(".tmp-0a1b2c3d-{w}"),
            format!(".tmp-rm-3f2a-{w}"),
            format!(".3f2a.materialising-{w}-17"),
            format!("{w}-1700000000000-0"),
        ] {
            assert_eq!(WriterId::in_name(&name), Some(w), "{name}");
        }
        // Names written before writers were named carry none.
        for name in [
            "4242-3-1700000000.partial",
            ".tmp-0a1b2c3d-4242",
            ".tmp-rm-3f2a",
            "+1-2",
            "1+-2",
            "x+1",
        ] {
            assert_eq!(WriterId::in_name(name), None, "{name}");
        }
    }

    #[test]
    fn only_a_dead_writers_or_an_old_unnamed_temporary_is_abandoned() {
        let now = SystemTime::now();
        let long_ago = now - UNIDENTIFIED_GRACE - Duration::from_secs(1);
        let me = WriterId::current();
        // A live writer keeps its temporary however old it is.
        assert!(!is_abandoned(&format!("{me}-0-0.partial"), long_ago));
        // Its pid with another start time is a reused pid: the writer is dead.
        let reused = WriterId {
            start_time: me.start_time + 1,
            ..me
        };
        assert!(is_abandoned(&format!("{reused}-0-0.partial"), now));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let exited = WriterId {
            pid: child.id() as i32,
            start_time: 0,
        };
        child.wait().unwrap();
        assert!(is_abandoned(&format!(".tmp-00-{exited}"), now));
        // No writer in the name: only its age counts.
        assert!(!is_abandoned("4242-0-0.partial", now));
        assert!(is_abandoned("4242-0-0.partial", long_ago));
        assert!(!is_abandoned("4242-0-0.partial", now + Duration::from_secs(60)));
    }
}
