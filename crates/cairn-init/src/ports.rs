//! Connections from the host to a TCP port inside the sandbox
//! ([`ToInit::ConnectPort`](cairn_protocol::ToInit::ConnectPort)): the
//! E2B gateway reaches a sandbox's servers this way (a code interpreter,
//! a dev server) whatever its network, on native and on gVisor alike.
//! Init connects on the sandbox's own loopback, answers `Done`, and from
//! then on copies bytes both ways, one thread each, until either side
//! closes. Nothing from the sandbox is read as a frame after `Done`.

use std::io::{self, Write};
use std::net::{Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use cairn_protocol::{write_frame, FrameError, FromInit};

use crate::hub::HostReader;

/// Port connections open at once; past it a request is refused.
pub const PORT_CONNECTIONS_MAX: usize = 256;

/// How long connecting may take (a listener whose backlog is full).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

static OPEN: AtomicUsize = AtomicUsize::new(0);

/// One open port connection, counted while it lives.
struct Counted;

impl Counted {
    fn take() -> Option<Counted> {
        let taken = OPEN.fetch_add(1, Ordering::SeqCst);
        if taken >= PORT_CONNECTIONS_MAX {
            OPEN.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        Some(Counted)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        OPEN.fetch_sub(1, Ordering::SeqCst);
    }
}

fn refuse(mut host: &UnixStream, message: String) -> Result<(), FrameError> {
    write_frame(&mut host, &FromInit::Error(message))?;
    host.flush()?;
    Ok(())
}

/// Connects to `port` on the loopback and relays until either side ends.
pub fn connect(port: u16, mut from_host: HostReader, host: UnixStream) -> Result<(), FrameError> {
    let Some(_counted) = Counted::take() else {
        return refuse(
            &host,
            format!("the sandbox has {PORT_CONNECTIONS_MAX} port connections open; close some and retry"),
        );
    };
    if port == 0 {
        return refuse(&host, "port 0 is not a TCP port (1-65535)".into());
    }
    let v4 = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let v6 = SocketAddr::from((Ipv6Addr::LOCALHOST, port));
    let tcp = match TcpStream::connect_timeout(&v4, CONNECT_TIMEOUT)
        .or_else(|e4| TcpStream::connect_timeout(&v6, CONNECT_TIMEOUT).map_err(|_| e4))
    {
        Ok(t) => t,
        Err(e) => return refuse(&host, format!("nothing answers on port {port} in the sandbox: {e}")),
    };
    let _ = tcp.set_nodelay(true);
    let (mut to_port, mut to_host) = match (tcp.try_clone(), host.try_clone()) {
        (Ok(t), Ok(h)) => (t, h),
        (Err(e), _) | (_, Err(e)) => return refuse(&host, format!("cannot relay port {port}: {e}")),
    };
    // Host to port on a thread of its own (started before `Done`, so no
    // byte the host sends next waits for it); port to host on this one.
    let upstream = std::thread::Builder::new().spawn(move || {
        let _ = io::copy(&mut from_host, &mut to_port);
        let _ = to_port.shutdown(Shutdown::Write);
    });
    let upstream = match upstream {
        Ok(t) => t,
        Err(e) => {
            return refuse(
                &host,
                format!("cannot relay port {port}: no thread ({e}): the sandbox is at its process limit"),
            )
        }
    };
    write_frame(&mut to_host, &FromInit::Done)?;
    to_host.flush()?;
    let mut from_port = tcp;
    let _ = io::copy(&mut from_port, &mut to_host);
    // The port closed (or the host stopped reading): the relay is over,
    // and the other thread's read from the host ends with it.
    let _ = to_host.shutdown(Shutdown::Both);
    let _ = upstream.join();
    Ok(())
}
