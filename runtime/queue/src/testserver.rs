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
        NatsServer::start_on(free_port())
    }

    /// [`NatsServer::start`] on `port` (one a test reserved, for a client started before it).
    pub fn start_on(port: u16) -> Result<NatsServer, String> {
        let bin = nats_server()?;
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

/// A cluster of nats-servers with JetStream on one address (three for a quorum that survives
/// one loss), each with a store directory of its own. Servers can be killed one by one.
#[derive(Debug)]
pub struct NatsCluster {
    pub nodes: Vec<Option<Child>>,
    /// Each node's client URL.
    pub urls: Vec<String>,
    _stores: Vec<tempfile::TempDir>,
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        for c in self.nodes.iter_mut().flatten() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl NatsCluster {
    /// Starts `n` servers listening on `addr` (an address of this host) and waits until
    /// each listens; `Err` says why none can be started here.
    pub fn start(n: usize, addr: &str) -> Result<NatsCluster, String> {
        let bin = nats_server()?;
        let ports: Vec<(u16, u16)> = (0..n).map(|_| (free_port(), free_port())).collect();
        let routes: Vec<String> = ports
            .iter()
            .map(|(_, c)| format!("nats://{addr}:{c}"))
            .collect();
        let mut nodes = Vec::new();
        let mut stores = Vec::new();
        for (i, (p, c)) in ports.iter().enumerate() {
            let store = tempfile::tempdir().unwrap();
            let child = Command::new(&bin)
                .args(["-js", "-a", addr, "-p", &p.to_string(), "-sd"])
                .arg(store.path())
                .args([
                    "--server_name",
                    &format!("n{i}"),
                    "--cluster_name",
                    "taskbox",
                ])
                .args(["--cluster", &format!("nats://{addr}:{c}")])
                .args(["--routes", &routes.join(",")])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            nodes.push(Some(child));
            stores.push(store);
        }
        for (p, _) in &ports {
            let since = Instant::now();
            while TcpStream::connect((addr, *p)).is_err() {
                assert!(
                    since.elapsed() < Duration::from_secs(10),
                    "nats-server did not listen on {addr}:{p} within 10 s"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Ok(NatsCluster {
            nodes,
            urls: ports
                .iter()
                .map(|(p, _)| format!("nats://{addr}:{p}"))
                .collect(),
            _stores: stores,
        })
    }

    /// Every node's URL, comma-separated (what clients are given).
    pub fn url(&self) -> String {
        self.urls.join(",")
    }

    /// SIGKILLs node `i`.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.nodes[i].take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn nats_server() -> Result<PathBuf, String> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/local/sbin")])
        .map(|d| d.join("nats-server"))
        .find(|p| p.is_file())
        .ok_or_else(|| "nats-server is not installed (scripts/ci.sh installs Debian's)".into())
}
