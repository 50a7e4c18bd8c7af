//! A real nats-server with JetStream for tests: on a free loopback port, with a store
//! directory of its own, killed when dropped. Tests that need one skip (or fail under
//! `TASKBOX_REQUIRE_ALL=1`) when [`NatsServer::start`] says why it cannot.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test helper fails the test by panicking

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct NatsServer {
    child: Child,
    pub url: String,
    _store: tempfile::TempDir,
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A loopback port nothing listens on (just now).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl NatsServer {
    /// Starts one and waits until it listens; `Err` says why none can be started here.
    pub fn start() -> Result<NatsServer, String> {
        let path = std::env::var_os("PATH").unwrap_or_default();
        let Some(bin) = std::env::split_paths(&path)
            .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/local/sbin")])
            .map(|d| d.join("nats-server"))
            .find(|p| p.is_file())
        else {
            return Err("nats-server is not installed (scripts/ci.sh installs Debian's)".into());
        };
        let port = free_port();
        let store = tempfile::tempdir().unwrap();
        let child = Command::new(bin)
            .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string(), "-sd"])
            .arg(store.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let server = NatsServer {
            child,
            url: format!("nats://127.0.0.1:{port}"),
            _store: store,
        };
        let since = Instant::now();
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                since.elapsed() < Duration::from_secs(10),
                "nats-server did not listen on {port} within 10 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(server)
    }
}
