//! Secrets a sandbox never sees, end to end: a real supervisor (`taskbox serve`) whose egress
//! proxy presents a policy's secrets (from its environment, from a file of its own, from the
//! create request) to TLS servers on the host's loopback, whose certificates a CA made by the
//! test (with the openssl CLI) signs; the supervisor is told to trust that CA
//! (`TASKBOX_EGRESS_CA`), the sandbox is not.
//!
//! Inside a native sandbox, curl sends the placeholders it finds in its environment: the bound
//! hosts get the values, every other host (a look-alike name, a redirect's target) gets the
//! placeholder; request rules refuse with the policy's reason; an upstream with a bad
//! certificate is refused with a violation that says so. Then everything the sandbox can look
//! at (every process's environment, command line and readable memory, the placeholder-holding
//! process's own memory, its files) is dumped and searched on the host, byte by byte, for the
//! values, with the trace, the observations, `/metrics` and every file of the state directory.
//! Rotation and revocation go through the HTTP API. Bad policies are refused naming the key.
//!
//! Needs root (namespaces), curl, openssl and /usr/bin/python3; skips with a reason otherwise
//! (`TASKBOX_REQUIRE_ALL=1`: fails).

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers fail the test by panicking

use std::fs;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};
use taskbox_tests::{Env, PYTHON, Supervisor, exists, is_root, require};

const GH: &str = "gh-TOPSECRET-7f3a9c1e5b2d4a6f";
const GH2: &str = "gh-ROTATED-1c9e8d7b6a5f4e3d";
const IDX: &str = "idx-TOPSECRET-0a0b0c0d0e0f1a1b";
const QK: &str = "qk-TOPSECRET/with+odd=chars&more";
const BAD: &str = "bad-TOPSECRET-deadbeefcafe0001";

/// Every form a value could take on the wire: itself, a query's %-encoding, basic auth.
fn forms() -> Vec<(String, Vec<u8>)> {
    use base64::Engine as _;
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let mut out: Vec<(String, Vec<u8>)> = [GH, GH2, IDX, QK, BAD]
        .iter()
        .map(|v| ((*v).to_owned(), v.as_bytes().to_vec()))
        .collect();
    out.push((
        "QK %-encoded".into(),
        b"qk-TOPSECRET%2Fwith%2Bodd%3Dchars%26more".to_vec(),
    ));
    out.push(("IDX in basic auth".into(), b64(&format!("ci:{IDX}")).into()));
    out
}

/// Panics when `haystack` holds any form of a secret.
fn assert_no_secret(what: &str, haystack: &[u8]) {
    for (name, needle) in forms() {
        if let Some(at) = memchr_find(haystack, &needle) {
            let from = at.saturating_sub(200);
            let to = (at + needle.len() + 200).min(haystack.len());
            panic!(
                "{what} holds the secret {name:?} at byte {at}: ...{}...",
                String::from_utf8_lossy(&haystack[from..to])
            );
        }
    }
}

fn memchr_find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    memchr::memmem::find(haystack, needle)
}

fn sha256_hex(text: &str) -> String {
    use sha2::Digest as _;
    sha2::Sha256::digest(text.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn have(tool: &str, arg: &str) -> bool {
    require(
        Command::new(tool)
            .arg(arg)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success()),
        &format!("{tool} is not installed"),
    )
}

fn prerequisites() -> bool {
    require(is_root(), "needs root (network namespaces)")
        && have("curl", "--version")
        && have("openssl", "version")
        && require(exists(PYTHON), "no /usr/bin/python3")
}

fn openssl(args: &[&str], dir: &Path) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA made now (`NAME.pem`, `NAME.key` in `dir`).
fn make_ca(dir: &Path, name: &str) {
    openssl(
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-days",
            "2",
            "-subj",
            &format!("/CN={name}"),
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.pem"),
        ],
        dir,
    );
}

/// A server certificate for `names` signed by CA `ca` (`LEAF.pem`, `LEAF.key`).
fn make_leaf(dir: &Path, ca: &str, leaf: &str, names: &[&str]) {
    openssl(
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-subj",
            &format!("/CN={}", names[0]),
            "-keyout",
            &format!("{leaf}.key"),
            "-out",
            &format!("{leaf}.csr"),
        ],
        dir,
    );
    let san: Vec<String> = names.iter().map(|n| format!("DNS:{n}")).collect();
    fs::write(
        dir.join(format!("{leaf}.ext")),
        format!(
            "subjectAltName={}\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n",
            san.join(",")
        ),
    )
    .unwrap();
    openssl(
        &[
            "x509",
            "-req",
            "-in",
            &format!("{leaf}.csr"),
            "-CA",
            &format!("{ca}.pem"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            &format!("{leaf}.ext"),
            "-out",
            &format!("{leaf}.pem"),
        ],
        dir,
    );
}

/// A TLS server on the host's loopback that says which secret each credential of a request is
/// (by the SHA-256 digests it is given, never the values): `GET /check host=api.test
/// bearer=gh basic=none key=qk`, `other` for a credential it does not know (a placeholder);
/// `/redirect?to=URL` answers 302 to URL.
const UPSTREAM: &str = r#"
import base64, hashlib, http.server, json, ssl, sys, urllib.parse
known = json.loads(sys.argv[3])
def who(v):
    if v is None:
        return "none"
    return known.get(hashlib.sha256(v.encode()).hexdigest(), "other")
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def answer(self):
        n = int(self.headers.get("Content-Length") or 0)
        if n:
            self.rfile.read(n)
        url = urllib.parse.urlsplit(self.path)
        if url.path == "/redirect":
            to = urllib.parse.parse_qs(url.query)["to"][0]
            self.send_response(302)
            self.send_header("Location", to)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        auth = self.headers.get("Authorization") or ""
        bearer = auth[7:] if auth.startswith("Bearer ") else None
        basic = None
        if auth.startswith("Basic "):
            basic = base64.b64decode(auth[6:]).decode().split(":", 1)[1]
        key = urllib.parse.parse_qs(url.query).get("key", [None])[0]
        api_key = self.headers.get("X-Api-Key")
        host = (self.headers.get("Host") or "").split(":")[0]
        body = (f"{self.command} {url.path} host={host} bearer={who(bearer)} basic={who(basic)} "
                f"key={who(key)} api_key={who(api_key)}\n").encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    do_GET = do_POST = answer
    def log_message(self, *args):
        pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain(sys.argv[1], sys.argv[2])
server.socket = context.wrap_socket(server.socket, server_side=True)
print(server.server_address[1], flush=True)
server.serve_forever()
"#;

/// A server process, killed on drop.
struct Server {
    child: Child,
    port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_upstream(dir: &Path, leaf: &str) -> Server {
    let known: serde_json::Map<String, Value> = [
        (GH, "gh"),
        (GH2, "gh2"),
        (IDX, "idx"),
        (QK, "qk"),
        (BAD, "bad"),
    ]
    .iter()
    .map(|(v, n)| (sha256_hex(v), Value::from(*n)))
    .collect();
    let mut child = Command::new(PYTHON)
        .args(["-c", UPSTREAM])
        .arg(dir.join(format!("{leaf}.pem")))
        .arg(dir.join(format!("{leaf}.key")))
        .arg(Value::Object(known).to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let port = line.trim().parse().unwrap();
    Server { child, port }
}

/// The names of the suite, all mapped to the host's loopback.
const NAMES: &[&str] = &[
    "api.test",
    "sub.api.test",
    "other.test",
    "api.test.evil.test",
    "pkg.test",
    "bad.test",
];

fn policy(secret_file: &Path) -> String {
    let hosts: String = NAMES
        .iter()
        .map(|n| format!("\"{n}\" = [\"127.0.0.1\"]\n"))
        .collect();
    format!(
        r#"
[network]
mode = "proxy"
allow = ["api.test", "*.api.test", "other.test", "api.test.evil.test", "pkg.test", "bad.test"]

[network.hosts]
{hosts}
[[network.requests]]
hosts = ["pkg.test"]
allow = ["GET /simple/**"]
deny = ["POST"]
deny_reason = "the package index is read-only for this task"

[secrets.gh]
from_env = "TASKBOX_TEST_GH_TOKEN"
hosts = ["api.test"]
header = "Authorization"
placeholder_env = "GH_TOKEN"

[secrets.idx]
from_file = "{}"
hosts = ["*.api.test"]
basic_user = "ci"

[secrets.qk]
from_api = true
hosts = ["api.test"]
query = "key"

[secrets.bad]
from_api = true
hosts = ["bad.test"]
header = "X-Api-Key"
"#,
        secret_file.display()
    )
}

/// Dumps all the sandbox can look at into the file `argv[1]`: every process's environment and
/// command line, the memory of every process it may read (its own, which made a request with a
/// placeholder and holds it, and a child's), and every readable file under the roots it is
/// given. Prints what it could not read among `argv[2]` (paths that must stay unreadable).
const DUMPER: &str = r#"
import os, subprocess, sys, urllib.request
out_path, must_fail, roots = sys.argv[1], sys.argv[2].split(","), sys.argv[3:]
# Use the placeholder the way a tool would: in a request through the proxy (to an inspected
# host, where the proxy replaces it), so this process holds it in memory.
token = os.environ["GH_TOKEN"]
port = os.environ["UPSTREAM_PORT"]
import ssl
ctx = ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])
req = urllib.request.Request(f"https://api.test:{port}/check", headers={"Authorization": "Bearer " + token})
print(urllib.request.urlopen(req, context=ctx, timeout=20).read().decode(), end="")
holder = subprocess.Popen(["sleep", "60"], env=dict(os.environ, HELD=token))
out = open(out_path, "wb")
def add(label, data):
    out.write(b"\n==== " + label.encode() + b"\n")
    out.write(data)
for pid in sorted(p for p in os.listdir("/proc") if p.isdigit()):
    for name in ("environ", "cmdline"):
        try:
            add(f"/proc/{pid}/{name}", open(f"/proc/{pid}/{name}", "rb").read())
        except OSError:
            pass
    try:
        maps = open(f"/proc/{pid}/maps").read().splitlines()
        mem = open(f"/proc/{pid}/mem", "rb", 0)
    except OSError:
        continue
    for line in maps:
        addr, perms = line.split()[:2]
        if not perms.startswith("r"):
            continue
        a, b = (int(x, 16) for x in addr.split("-"))
        if b - a > (256 << 20):
            continue
        try:
            mem.seek(a)
            add(f"mem {pid} {line}", mem.read(b - a))
        except (OSError, ValueError, OverflowError):
            pass
holder.kill()
for root in roots:
    for dirpath, dirnames, filenames in os.walk(root):
        if dirpath.startswith(("/proc", "/sys", "/dev")):
            dirnames[:] = []
            continue
        for name in filenames:
            p = os.path.join(dirpath, name)
            if os.path.abspath(p) == os.path.abspath(out_path):
                continue
            try:
                if os.path.islink(p) or not os.path.isfile(p) or os.path.getsize(p) > (64 << 20):
                    continue
                add(p, open(p, "rb").read())
            except OSError:
                pass
out.close()
for p in must_fail:
    try:
        open(p, "rb").read()
        print("READABLE", p)
    except OSError as e:
        print("unreadable", p)
"#;

fn exec(s: &Supervisor, id: &str, req: Value) -> Value {
    let (status, r) = s.call("POST", &format!("/v1/sandboxes/{id}/exec"), Some(req));
    assert_eq!(status, 200, "{r:#}");
    r
}

fn download(s: &Supervisor, id: &str, path: &str) -> Vec<u8> {
    use taskbox_agent::http::{Client, Request};
    let target = format!("/v1/sandboxes/{id}/files?path={path}");
    let req = Request::new("GET", &target);
    let r = Client::unix(&s.socket)
        .and_then(|c| c.send(&req, Duration::MAX))
        .unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r.body
}

fn files_under(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let Ok(ft) = e.file_type() else { continue };
        if ft.is_dir() {
            files_under(&e.path(), out);
        } else if ft.is_file() {
            out.push(e.path());
        }
    }
}

#[test]
fn a_session_that_used_secrets_leaves_their_values_nowhere_the_sandbox_can_look() {
    if !prerequisites() {
        return;
    }
    let env = Env::new();
    let certs = tempfile::tempdir().unwrap();
    make_ca(certs.path(), "testca");
    make_leaf(certs.path(), "testca", "good", NAMES);
    // A CA nobody trusts signs the certificate of bad.test.
    make_ca(certs.path(), "strangerca");
    make_leaf(certs.path(), "strangerca", "bad", &["bad.test"]);
    let good = start_upstream(certs.path(), "good");
    let bad = start_upstream(certs.path(), "bad");
    let port = good.port;

    // The file secret lives in the supervisor's state directory, which no sandbox sees.
    let secrets_dir = env.state().join("secret-files");
    fs::create_dir_all(&secrets_dir).unwrap();
    let idx_file = secrets_dir.join("idx");
    fs::write(&idx_file, format!("{IDX}\n")).unwrap();
    let policy_path = env.policy("secrets", &policy(&idx_file));
    fs::copy(certs.path().join("testca.pem"), env.ws().join("testca.pem")).unwrap();
    let ca_path = certs.path().join("testca.pem");
    let s = Supervisor::start_with(&env, &[], |cmd| {
        cmd.env("TASKBOX_TEST_GH_TOKEN", GH)
            .env("TASKBOX_EGRESS_CA", &ca_path);
    });
    let (status, info) = s.call(
        "POST",
        "/v1/sandboxes",
        Some(json!({
            "workspace": env.ws(),
            "policy": "secrets",
            "policy_toml": taskbox_tests::policy_text(&policy_path),
            "secrets": {"qk": QK, "bad": BAD},
        })),
    );
    assert_eq!(status, 201, "{info:#}");
    let id = info["id"].as_str().unwrap().to_owned();
    let mut observations: Vec<u8> = serde_json::to_vec(&info).unwrap();

    // The clients, by the variables alone; the hosts that stay tunnels present the test CA's
    // certificates, which the sandbox's bundle does not hold: those calls add it.
    let script = format!(
        r#"cat "$SSL_CERT_FILE" testca.pem > /tmp/with-test-ca.pem
tunnel() {{ CURL_CA_BUNDLE=/tmp/with-test-ca.pem curl -sS "$@"; }}
curl -sS -H "Authorization: Bearer $GH_TOKEN" "https://api.test:{port}/check?key=$TASKBOX_SECRET_QK"
curl -sS -u "ci:$TASKBOX_SECRET_IDX" "https://sub.api.test:{port}/check"
tunnel -H "Authorization: Bearer $GH_TOKEN" "https://other.test:{port}/check?key=$TASKBOX_SECRET_QK"
tunnel -H "Authorization: Bearer $GH_TOKEN" "https://api.test.evil.test:{port}/check"
CURL_CA_BUNDLE=/tmp/with-test-ca.pem curl -sS -L --location-trusted -H "Authorization: Bearer $GH_TOKEN" "https://api.test:{port}/redirect?to=https://other.test:{port}/landing"
curl -sS -X POST -w '%{{http_code}}\n' "https://pkg.test:{port}/simple/demo/"
curl -sS "https://pkg.test:{port}/simple/demo/"
curl -sS -H "X-Api-Key: $TASKBOX_SECRET_BAD" -w '%{{http_code}}\n' "https://bad.test:{}/x"
echo "vars: $SSL_CERT_FILE $REQUESTS_CA_BUNDLE $NODE_EXTRA_CA_CERTS $GIT_SSL_CAINFO $PIP_CERT $CARGO_HTTP_CAINFO"
"#,
        bad.port
    );
    let r = exec(&s, &id, json!({"shell": script}));
    observations.extend(serde_json::to_vec(&r).unwrap());
    let out = r["stdout"]["text"].as_str().unwrap();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines[..5],
        [
            "GET /check host=api.test bearer=gh basic=none key=qk api_key=none",
            "GET /check host=sub.api.test bearer=none basic=idx key=none api_key=none",
            "GET /check host=other.test bearer=other basic=none key=other api_key=none",
            "GET /check host=api.test.evil.test bearer=other basic=none key=none api_key=none",
            "GET /landing host=other.test bearer=other basic=none key=none api_key=none",
        ],
        "{r:#}"
    );
    let reason = "the package index is read-only for this task";
    assert_eq!(
        lines[5],
        format!(
            "request POST pkg.test:{port}/simple/demo/ denied: {reason}; the policy's \
             network.requests[0] decides requests to this host"
        )
    );
    assert_eq!(lines[6], "403");
    assert_eq!(
        lines[7],
        "GET /simple/demo/ host=pkg.test bearer=none basic=none key=none api_key=none"
    );
    assert!(
        lines[8].starts_with(&format!(
            "connect bad.test:{} denied: the certificate of bad.test:{} is not valid",
            bad.port, bad.port
        )),
        "{}",
        lines[8]
    );
    assert_eq!(lines[9], "502");
    let bundle = "/tmp/.taskbox/egress/ca.pem";
    assert_eq!(lines[10], format!("vars: {}", [bundle; 6].join(" ")));
    // The refusals are the exec's violations, with the policy's reason and the certificate.
    let details: Vec<&str> = r["violations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["detail"].as_str().unwrap())
        .collect();
    assert_eq!(details.len(), 2, "{details:#?}");
    assert!(details[0].contains(reason), "{details:#?}");
    assert!(details[1].contains("is not valid"), "{details:#?}");
    let net = &r["network"];
    assert_eq!(net["requests_denied"], 1, "{net:#}");
    let uses: Vec<(String, String, u64)> = net["secrets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|u| {
            (
                u["secret"].as_str().unwrap().to_owned(),
                u["host"].as_str().unwrap().to_owned(),
                u["requests"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        uses,
        [
            ("gh".to_owned(), "api.test".to_owned(), 2),
            ("qk".to_owned(), "api.test".to_owned(), 2),
            ("idx".to_owned(), "sub.api.test".to_owned(), 1),
        ],
        "{net:#}"
    );

    // Everything the sandbox can look at, dumped by a process that used a placeholder.
    let must_fail = idx_file.display().to_string();
    let r = exec(
        &s,
        &id,
        json!({
            "argv": [PYTHON, "-c", DUMPER, "dump.bin", must_fail,
                     "/tmp", "/run", "/var/tmp", ".", "/root", "/home", "/etc"],
            "env": {"UPSTREAM_PORT": port.to_string()},
            "timeout_ms": 300000,
        }),
    );
    observations.extend(serde_json::to_vec(&r).unwrap());
    assert_eq!(r["exit_code"], 0, "{r:#}");
    let out = r["stdout"]["text"].as_str().unwrap();
    assert!(
        out.starts_with("GET /check host=api.test bearer=gh"),
        "{out}"
    );
    assert!(
        out.contains(&format!("unreadable {}", idx_file.display())),
        "{out}"
    );
    assert!(!out.contains("READABLE"), "{out}");
    let dump = download(&s, &id, "dump.bin");
    assert!(
        dump.len() > 1 << 20,
        "the dump is only {} bytes",
        dump.len()
    );
    let gh_placeholder = "taskbox-placeholder-gh-";
    assert!(
        memchr_find(&dump, gh_placeholder.as_bytes()).is_some(),
        "the dump does not even hold the placeholder: it dumped too little"
    );
    assert_no_secret("what the sandbox can read", &dump);

    // Rotation and revocation through the API, on the live sandbox.
    let check = json!({"shell": format!(
        "curl -sS -H \"Authorization: Bearer $GH_TOKEN\" https://api.test:{port}/check")});
    let (status, st) = s.call(
        "PUT",
        &format!("/v1/sandboxes/{id}/secrets/gh"),
        Some(json!({"value": GH2})),
    );
    assert_eq!(status, 200, "{st:#}");
    assert_eq!(
        st,
        json!({"name": "gh", "hosts": ["api.test"], "placeholder_env": "GH_TOKEN",
               "state": "active", "rotations": 1})
    );
    let r = exec(&s, &id, check.clone());
    observations.extend(serde_json::to_vec(&r).unwrap());
    assert!(
        r["stdout"]["text"].as_str().unwrap().contains("bearer=gh2"),
        "{r:#}"
    );
    let (status, st) = s.call("DELETE", &format!("/v1/sandboxes/{id}/secrets/gh"), None);
    assert_eq!(status, 200, "{st:#}");
    assert_eq!(st["state"], "revoked");
    let r = exec(&s, &id, check);
    observations.extend(serde_json::to_vec(&r).unwrap());
    assert!(
        r["stdout"]["text"]
            .as_str()
            .unwrap()
            .contains("bearer=other"),
        "{r:#}"
    );
    let (status, e) = s.call(
        "PUT",
        &format!("/v1/sandboxes/{id}/secrets/nope"),
        Some(json!({"value": "x"})),
    );
    assert_eq!(status, 404, "{e:#}");
    let (status, e) = s.call(
        "PUT",
        &format!("/v1/sandboxes/{id}/secrets/gh"),
        Some(json!({"value": "two\nlines"})),
    );
    assert_eq!(status, 400, "{e:#}");

    // /metrics counts every use, by sandbox, secret and host.
    let metrics = download_text(&s, "/metrics");
    assert!(
        metrics.contains(&format!(
            "taskbox_egress_secret_uses_total{{sandbox=\"{id}\",secret=\"gh\",host=\"api.test\"}} 4"
        )),
        "{metrics}"
    );
    assert!(
        metrics.contains(&format!(
            "taskbox_egress_secret_uses_total{{sandbox=\"{id}\",secret=\"idx\",host=\"sub.api.test\"}} 1"
        )),
        "{metrics}"
    );
    assert_no_secret("/metrics", metrics.as_bytes());

    let (status, _) = s.call("DELETE", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(status, 204);
    drop(s);

    // The trace: the create's secrets by name, the rotation and the revocation without value.
    let trace_path = env.state().join("traces").join(format!("{id}.jsonl"));
    let trace = fs::read_to_string(&trace_path).unwrap();
    let ops: Vec<Value> = trace
        .lines()
        .skip(1)
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|v| v["type"] == "op")
        .collect();
    let names: Vec<&str> = ops.iter().map(|o| o["op"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "create", "exec", "exec", "download", "secret", "exec", "secret", "exec", "secret",
            "secret", "destroy"
        ],
        "{trace}"
    );
    assert_eq!(
        ops[0]["request"]["secrets"],
        json!({"qk": "[redacted]", "bad": "[redacted]"})
    );
    assert_eq!(ops[4]["request"], json!({"name": "gh", "action": "rotate"}));
    assert_eq!(ops[6]["request"], json!({"name": "gh", "action": "revoke"}));
    assert_eq!(
        ops[1]["outcome"]["ok"]["network"]["secrets"][0]["secret"],
        "gh"
    );
    // Nothing of the observations, and no file the supervisor wrote (the trace, the sandbox's
    // plan and logs, its CA bundle), holds a value: only the secret's own file does.
    assert_no_secret("the observations", &observations);
    let mut files = Vec::new();
    files_under(&env.state(), &mut files);
    assert!(files.contains(&trace_path));
    for f in files {
        // The secret's own file; and the empty file systems the sandboxes' disks are copied
        // from (sparse, gigabytes), made before any sandbox existed.
        if f == idx_file || f.starts_with(env.state().join("disk-templates")) {
            continue;
        }
        let bytes = fs::read(&f).unwrap_or_default();
        assert_no_secret(&f.display().to_string(), &bytes);
    }
}

fn download_text(s: &Supervisor, path: &str) -> String {
    use taskbox_agent::http::{Client, Request};
    let req = Request::new("GET", path);
    let r = Client::unix(&s.socket)
        .and_then(|c| c.send(&req, Duration::MAX))
        .unwrap();
    assert_eq!(r.status, 200);
    String::from_utf8_lossy(&r.body).into_owned()
}

#[test]
fn a_one_shot_run_presents_a_secret_from_its_environment() {
    if !prerequisites() {
        return;
    }
    let env = Env::new();
    let certs = tempfile::tempdir().unwrap();
    make_ca(certs.path(), "testca");
    make_leaf(certs.path(), "testca", "good", NAMES);
    let good = start_upstream(certs.path(), "good");
    let policy = env.policy(
        "one-shot",
        "[network]\nmode = \"proxy\"\nallow = [\"api.test\"]\n[network.hosts]\n\
         \"api.test\" = [\"127.0.0.1\"]\n[secrets.gh]\nfrom_env = \"TASKBOX_TEST_GH_TOKEN\"\n\
         hosts = [\"api.test\"]\nheader = \"Authorization\"\n",
    );
    let out = env
        .command()
        .args(["run", "--json", "--policy", policy.to_str().unwrap(), "--"])
        .args(["sh", "-c"])
        .arg(format!(
            "curl -sS -H \"Authorization: Bearer $TASKBOX_SECRET_GH\" https://api.test:{}/check",
            good.port
        ))
        .env("TASKBOX_TEST_GH_TOKEN", GH)
        .env("TASKBOX_EGRESS_CA", certs.path().join("testca.pem"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(
        r["stdout"]["text"],
        "GET /check host=api.test bearer=gh basic=none key=none api_key=none\n",
        "{r:#}"
    );
    assert_no_secret("the one-shot observation", stdout.as_bytes());
    // Without the variable, the run is refused before anything starts, naming the key, and
    // leaves nothing on the host (its cgroup was left behind once).
    let child = env
        .command()
        .args(["run", "--policy", policy.to_str().unwrap(), "--", "true"])
        .env_remove("TASKBOX_TEST_GH_TOKEN")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(125));
    assert_eq!(
        taskbox_tests::run_cgroups_of(pid),
        Vec::<String>::new(),
        "the refused run left its cgroups"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("secrets.gh.from_env: TASKBOX_TEST_GH_TOKEN is not set"),
        "{stderr}"
    );
}

#[test]
fn bad_secret_policies_and_missing_values_are_refused_naming_the_key() {
    let env = Env::new();
    let s = Supervisor::start(&env, &[]);
    let base = "[network]\nmode = \"proxy\"\nallow = [\"api.test\"]\n";
    for (body, want) in [
        (
            "[secrets.gh]\nfrom_api = true\nhosts = [\"*\"]\nheader = \"Authorization\"\n",
            "secrets.gh.hosts[0]: \"*\" would mean every host",
        ),
        (
            "[secrets.gh]\nfrom_api = true\nhosts = [\"10.0.0.0/8\"]\nheader = \"Authorization\"\n",
            "secrets.gh.hosts[0]: \"10.0.0.0/8\" is an address pattern",
        ),
        (
            "[secrets.gh]\nfrom_api = true\nheader = \"Authorization\"\n",
            "secrets.gh.hosts: lists no host",
        ),
        (
            "[secrets.gh]\nfrom_api = true\nhosts = [\"api.test\"]\n",
            "secrets.gh: give exactly one of header, basic_user and query",
        ),
        (
            "[[network.requests]]\nhosts = [\"*\"]\ndeny = [\"POST\"]\n",
            "network.requests[0].hosts[0]: \"*\" would mean every host",
        ),
    ] {
        let (status, e) = s.call(
            "POST",
            "/v1/sandboxes",
            Some(
                json!({"workspace": env.ws(), "policy_toml": format!("{base}{body}"),
                        "secrets": {"gh": "v"}}),
            ),
        );
        assert_eq!(status, 400, "{body}: {e:#}");
        let message = e["error"]["message"].as_str().unwrap();
        assert!(message.contains(want), "{message} (wanted {want})");
        assert!(!message.contains("\"v\""), "{message}");
    }
    // A good policy whose value is missing, or comes for a secret the policy does not take
    // from the API: refused, naming the secret; never echoing a value.
    let good = format!(
        "{base}[secrets.gh]\nfrom_api = true\nhosts = [\"api.test\"]\nheader = \"X-Key\"\n"
    );
    for (secrets, want) in [
        (json!({}), "secrets.gh: comes from the API"),
        (
            json!({"gh": "hunter2-value", "other": "hunter2-value"}),
            "secrets.other: the policy has no such secret",
        ),
        (json!({"gh": ""}), "secrets.gh: the value is empty"),
    ] {
        let (status, e) = s.call(
            "POST",
            "/v1/sandboxes",
            Some(json!({"workspace": env.ws(), "policy_toml": good, "secrets": secrets})),
        );
        assert_eq!(status, 400, "{e:#}");
        let message = e["error"]["message"].as_str().unwrap();
        assert!(message.contains(want), "{message} (wanted {want})");
        assert!(!message.contains("hunter2"), "{message}");
    }
    // `taskbox policy check` says the same of a file.
    let path = env.policy(
        "bad",
        &format!("{base}[secrets.gh]\nfrom_api = true\nhosts = [\"*\"]\nheader = \"X-Key\"\n"),
    );
    let out = env
        .command()
        .args(["policy", "check"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("secrets.gh.hosts[0]"), "{stderr}");
}

/// What a container of the Docker backend sends: python's urllib with the proxy, the CA bundle
/// and the placeholder it finds in its environment (`[status, body]`), and its environment.
const CONTAINER_FETCH: &str = r#"
import json, os, sys, urllib.request
url = sys.argv[1]
req = urllib.request.Request(url, headers={"Authorization": "Bearer " + os.environ["GH_TOKEN"]})
try:
    with urllib.request.urlopen(req, timeout=20) as r:
        got = [r.status, r.read().decode()]
except Exception as e:
    got = ["error", type(e).__name__ + ": " + str(e)]
print(json.dumps({"got": got, "env": dict(os.environ),
                  "bundle": open(os.environ["SSL_CERT_FILE"]).read().count("BEGIN CERTIFICATE")}))
"#;

#[test]
fn docker_a_container_gets_the_ca_and_a_placeholder_and_the_proxy_presents_the_secret() {
    let Some(env) = Env::for_backend(taskbox_tests::Backend::Docker) else {
        return;
    };
    if !have("openssl", "version") || !require(exists(PYTHON), "no /usr/bin/python3") {
        return;
    }
    let certs = tempfile::tempdir().unwrap();
    make_ca(certs.path(), "testca");
    make_leaf(certs.path(), "testca", "good", NAMES);
    let good = start_upstream(certs.path(), "good");
    let policy = "[network]\nmode = \"proxy\"\nallow = [\"api.test\"]\n[network.hosts]\n\
                  \"api.test\" = [\"127.0.0.1\"]\n[secrets.gh]\nfrom_api = true\n\
                  hosts = [\"api.test\"]\nheader = \"Authorization\"\n\
                  placeholder_env = \"GH_TOKEN\"\n";
    fs::write(env.ws().join("fetch.py"), CONTAINER_FETCH).unwrap();
    let ca_path = certs.path().join("testca.pem");
    let s = Supervisor::start_with(&env, &["--docker"], |cmd| {
        cmd.env("TASKBOX_EGRESS_CA", &ca_path);
    });
    let (status, info) = s.call(
        "POST",
        "/v1/sandboxes",
        Some(json!({"workspace": env.ws(), "backend": "docker",
                    "image": taskbox_tests::SUITE_IMAGE, "policy_toml": policy,
                    "secrets": {"gh": GH}})),
    );
    assert_eq!(status, 201, "{info:#}");
    let id = info["id"].as_str().unwrap().to_owned();
    let url = format!("https://api.test:{}/check", good.port);
    let r = exec(&s, &id, json!({"argv": ["python3", "fetch.py", url]}));
    let text = r["stdout"]["text"].as_str().unwrap();
    let f: Value = serde_json::from_str(text).unwrap_or_else(|_| panic!("{r:#}"));
    assert_eq!(
        f["got"],
        json!([
            200,
            "GET /check host=api.test bearer=gh basic=none key=none api_key=none\n"
        ]),
        "{f:#}"
    );
    assert!(
        f["env"]["GH_TOKEN"]
            .as_str()
            .unwrap()
            .starts_with("taskbox-placeholder-gh-"),
        "{f:#}"
    );
    assert_eq!(f["env"]["SSL_CERT_FILE"], "/tmp/.taskbox/egress/ca.pem");
    assert!(f["bundle"].as_u64().unwrap() >= 1, "{f:#}");
    assert_eq!(r["network"]["secrets"][0]["secret"], "gh", "{r:#}");
    assert_no_secret(
        "the container's observation",
        &serde_json::to_vec(&r).unwrap(),
    );
    let (status, st) = s.call("DELETE", &format!("/v1/sandboxes/{id}/secrets/gh"), None);
    assert_eq!((status, st["state"].as_str()), (200, Some("revoked")));
    let r = exec(&s, &id, json!({"argv": ["python3", "fetch.py", url]}));
    let f: Value = serde_json::from_str(r["stdout"]["text"].as_str().unwrap()).unwrap();
    assert!(
        f["got"][1].as_str().unwrap().contains("bearer=other"),
        "{f:#}"
    );
    let (status, _) = s.call("DELETE", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(status, 204);
    let trace = fs::read(env.state().join("traces").join(format!("{id}.jsonl"))).unwrap();
    assert_no_secret("the container's trace", &trace);
}
