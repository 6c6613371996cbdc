//! Reading `/proc` to tell whether a host process is still the one we started.

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
    }
}
