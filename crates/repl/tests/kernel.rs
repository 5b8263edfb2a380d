//! Runs the kernel program (`kernel.py`) directly on this host with the
//! host's python3, no VM and no agent, through a small stdin/stdout driver
//! speaking its wire protocol.
//!
//! The pandas and matplotlib tests install those packages for the host
//! python when missing; without `CI` set they are skipped if that fails.

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The longest a test waits for any one reply line: a kernel that never
/// answers fails its test instead of hanging the suite.
const REPLY_TIMEOUT: Duration = Duration::from_secs(120);

/// One kernel process, killed (by its pid) when dropped.
struct Kernel {
    child: Child,
    stdin: ChildStdin,
    /// Lines of its stdout, read by a thread of their own (which ends when
    /// the kernel's stdout closes), so reads can time out.
    lines: Receiver<std::io::Result<String>>,
    next_id: u64,
    pid: u32,
}

impl Kernel {
    fn start() -> Kernel {
        let mut child = Command::new("python3")
            .arg("-u")
            .arg("-c")
            .arg(shoal_repl::KERNEL_SOURCE)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("python3 runs on this host");
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || loop {
            let mut line = String::new();
            match stdout.read_line(&mut line) {
                Ok(0) => return,
                Ok(_) => {
                    if tx.send(Ok(line)).is_err() {
                        return;
                    }
                }
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return;
                }
            }
        });
        let mut kernel = Kernel {
            child,
            stdin,
            lines,
            next_id: 1,
            pid: 0,
        };
        let ready = kernel.read_line();
        assert_eq!(ready["ready"], json!(true), "{ready}");
        kernel.pid = u32::try_from(ready["pid"].as_u64().unwrap()).unwrap();
        assert_eq!(kernel.pid, kernel.child.id());
        kernel
    }

    fn read_line(&mut self) -> Value {
        self.read_line_within(REPLY_TIMEOUT)
    }

    /// The next protocol line; panics (the kernel is killed on drop) if
    /// none comes within `timeout`.
    fn read_line_within(&mut self, timeout: Duration) -> Value {
        let line = match self.lines.recv_timeout(timeout) {
            Ok(line) => line.expect("reading the kernel's stdout"),
            Err(RecvTimeoutError::Timeout) => {
                panic!("no line from the kernel in {timeout:?}")
            }
            Err(RecvTimeoutError::Disconnected) => panic!("the kernel closed its stdout"),
        };
        assert!(line.ends_with('\n'));
        assert!(line.is_ascii(), "protocol lines are ASCII");
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("bad line {line:?}: {e}"))
    }

    fn send(&mut self, code: &str) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        let mut line = serde_json::to_string(&json!({"id": id, "code": code})).unwrap();
        line.push('\n');
        self.stdin.write_all(line.as_bytes()).unwrap();
        self.stdin.flush().unwrap();
        id
    }

    fn run(&mut self, code: &str) -> Value {
        let id = self.send(code);
        let reply = self.read_line();
        assert_eq!(reply["id"], json!(id), "{reply}");
        reply
    }

    /// The `text/plain` of the cell's first result.
    fn value(&mut self, code: &str) -> String {
        let reply = self.run(code);
        assert_eq!(reply["exit_code"], 0, "{reply}");
        reply["results"][0]["text/plain"]
            .as_str()
            .unwrap_or_else(|| panic!("no value: {reply}"))
            .to_string()
    }

    fn sigint(&self) {
        // SAFETY: kill has no memory effects; the pid is our own child's,
        // not yet reaped.
        unsafe { libc::kill(self.pid as i32, libc::SIGINT) };
    }
}

impl Drop for Kernel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn results(reply: &Value) -> &Vec<Value> {
    reply["results"].as_array().expect("results is an array")
}

/// Whether pandas and matplotlib import in the host python, installing them
/// with pip once if not.
fn have_scientific_stack() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        let importable = || {
            Command::new("python3")
                .args(["-c", "import pandas, matplotlib"])
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        if importable() {
            return true;
        }
        let _ = Command::new("python3")
            .args(["-m", "pip", "install", "--quiet", "pandas", "matplotlib"])
            .status();
        if importable() {
            return true;
        }
        assert!(
            std::env::var_os("CI").is_none(),
            "pandas and matplotlib are required in CI, and pip could not install them"
        );
        eprintln!("skipping: pandas/matplotlib not importable and pip failed");
        false
    })
}

/// Decodes standard base64 (enough for checking a PNG's first bytes).
fn base64_decode(text: &str) -> Vec<u8> {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = Vec::new();
    let mut acc = 0u32;
    let mut bits = 0;
    for byte in text.bytes().take_while(|&b| b != b'=') {
        let value = ALPHABET
            .iter()
            .position(|&c| c == byte)
            .unwrap_or_else(|| panic!("not base64: {byte:?}")) as u32;
        acc = (acc << 6) | value;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    out
}

#[test]
fn state_is_kept_and_the_last_expression_is_the_value() {
    let mut k = Kernel::start();
    let reply = k.run("x = 41");
    assert_eq!(reply["exit_code"], 0);
    assert!(results(&reply).is_empty());
    assert_eq!(reply["error"], Value::Null);
    assert_eq!(k.value("x + 1"), "42");
    assert_eq!(k.value("def f(n):\n    return n * 2\nf(x)"), "82");
    assert_eq!(k.value("import math\nmath.floor(2.5)"), "2");
    assert_eq!(k.value("math.pi > 3"), "True");
    assert_eq!(k.value("'text'"), "'text'");
    // A None value and a statement at the end give no result.
    assert!(results(&k.run("None")).is_empty());
    assert!(results(&k.run("y = x\nif y:\n    z = 1")).is_empty());
    // The namespace is __main__, and it is sys.modules["__main__"].
    assert_eq!(
        k.value("import sys\n__name__, sys.modules['__main__'].x"),
        "('__main__', 41)"
    );
    // Classes defined in a cell pickle (found through __main__).
    assert_eq!(
        k.value("import pickle\nclass P:\n    v = 3\npickle.loads(pickle.dumps(P())).v"),
        "3"
    );
    // Top-level await, and __future__ imports that last.
    assert_eq!(
        k.value("import asyncio\nawait asyncio.sleep(0)\n'awaited'"),
        "'awaited'"
    );
    k.run("from __future__ import annotations");
    assert_eq!(
        k.value("def g(a: NotDefined): pass\ng.__annotations__"),
        "{'a': 'NotDefined'}"
    );
}

#[test]
fn empty_code_gives_an_empty_reply() {
    let mut k = Kernel::start();
    for code in ["", "   \n\n"] {
        let reply = k.run(code);
        assert_eq!(reply["stdout"], "");
        assert_eq!(reply["stderr"], "");
        assert_eq!(reply["error"], Value::Null);
        assert_eq!(reply["exit_code"], 0);
        assert!(results(&reply).is_empty());
    }
}

#[test]
fn an_exception_gives_its_traceback_and_keeps_state() {
    let mut k = Kernel::start();
    k.run("kept = 'yes'");
    let reply = k.run("print('before')\npartial = 1\n1/0");
    assert_eq!(reply["exit_code"], 1);
    let error = reply["error"].as_str().unwrap();
    assert!(
        error.starts_with("Traceback (most recent call last):"),
        "{error}"
    );
    assert!(
        error.ends_with("ZeroDivisionError: division by zero"),
        "{error}"
    );
    assert!(error.contains("<cell-"), "{error}");
    assert!(
        !error.contains("kernel"),
        "the kernel's frames are hidden: {error}"
    );
    let stderr = reply["stderr"].as_str().unwrap();
    assert!(stderr.ends_with(&format!("{error}\n")), "{stderr}");
    assert_eq!(reply["stdout"], "before\n");
    assert_eq!(k.value("kept, partial"), "('yes', 1)");

    // Frames of functions from earlier cells show their source lines.
    k.run("def boom():\n    raise ValueError('bad value')");
    let reply = k.run("boom()");
    let error = reply["error"].as_str().unwrap();
    assert!(error.contains("raise ValueError('bad value')"), "{error}");
    assert!(error.ends_with("ValueError: bad value"), "{error}");

    // A syntax error: just the error, no traceback.
    let reply = k.run("1 +");
    assert_eq!(reply["exit_code"], 1);
    let error = reply["error"].as_str().unwrap();
    assert!(error.ends_with("SyntaxError: invalid syntax"), "{error}");
    assert!(!error.contains("Traceback"), "{error}");

    // A lone surrogate in a message still gives valid JSON (read_line
    // parses it).
    let reply = k.run("raise KeyError('\\udc80')");
    assert_eq!(reply["exit_code"], 1);
    assert_eq!(k.value("kept"), "'yes'");
}

#[test]
fn system_exit_sets_the_exit_code_and_keeps_the_session() {
    let mut k = Kernel::start();
    k.run("v = 7");
    let reply = k.run("import sys\nprint('bye')\nsys.exit(3)");
    assert_eq!(reply["exit_code"], 3);
    assert_eq!(reply["error"], Value::Null);
    assert_eq!(reply["stdout"], "bye\n");
    assert_eq!(k.run("sys.exit()")["exit_code"], 0);
    let reply = k.run("sys.exit('a message')");
    assert_eq!(reply["exit_code"], 1);
    assert_eq!(reply["stderr"], "a message\n");
    let reply = k.run("raise SystemExit(0)");
    assert_eq!(reply["exit_code"], 0);
    assert_eq!(k.value("v"), "7");
}

#[test]
fn output_is_captured_from_python_subprocesses_and_descriptors() {
    let mut k = Kernel::start();
    let reply = k.run(
        "import os, sys, subprocess\n\
         print('one')\n\
         print('warn', file=sys.stderr)\n\
         os.system('echo two; echo err2 >&2')\n\
         os.write(1, b'three\\n')\n\
         subprocess.run(['sh', '-c', 'echo four'])\n\
         print('caf\\u00e9 \\u2603')",
    );
    assert_eq!(reply["exit_code"], 0, "{reply}");
    assert_eq!(
        reply["stdout"],
        "one\ntwo\nthree\nfour\ncaf\u{e9} \u{2603}\n"
    );
    assert_eq!(reply["stderr"], "warn\nerr2\n");
    // Each cell has only its own output.
    let reply = k.run("print('next')");
    assert_eq!(reply["stdout"], "next\n");
    assert_eq!(reply["stderr"], "");
    // Stdin is not the protocol: input() sees end of file.
    let reply = k.run("input()");
    assert!(reply["error"]
        .as_str()
        .unwrap()
        .ends_with("EOFError: EOF when reading a line"));
    // Printing without a newline, and a large output in one reply line.
    assert_eq!(k.run("print('no newline', end='')")["stdout"], "no newline");
    let reply = k.run("print('x' * 3_000_000)");
    assert_eq!(reply["stdout"].as_str().unwrap().len(), 3_000_001);
    assert_eq!(k.value("1 + 1"), "2");
}

#[test]
fn rich_representations_make_a_mime_bundle() {
    let mut k = Kernel::start();
    let reply = k.run(
        "class Rich:\n\
         \x20   def __repr__(self): return 'Rich()'\n\
         \x20   def _repr_html_(self): return '<b>rich</b>'\n\
         \x20   def _repr_markdown_(self): return '**rich**'\n\
         \x20   def _repr_png_(self): return b'\\x89PNG fake'\n\
         \x20   def _repr_json_(self): return {'a': [1, 2]}\n\
         \x20   def _repr_latex_(self): return None\n\
         \x20   def _repr_svg_(self): raise RuntimeError('no svg')\n\
         Rich()",
    );
    assert_eq!(reply["exit_code"], 0, "{reply}");
    let bundle = &results(&reply)[0];
    assert_eq!(bundle["text/plain"], "Rich()");
    assert_eq!(bundle["text/html"], "<b>rich</b>");
    assert_eq!(bundle["text/markdown"], "**rich**");
    assert_eq!(
        base64_decode(bundle["image/png"].as_str().unwrap()),
        b"\x89PNG fake"
    );
    let json: Value = serde_json::from_str(bundle["application/json"].as_str().unwrap()).unwrap();
    assert_eq!(json, json!({"a": [1, 2]}));
    assert!(bundle.get("text/latex").is_none());
    assert!(bundle.get("image/svg+xml").is_none());
    // A class is shown by its repr only.
    let reply = k.run("Rich");
    assert_eq!(results(&reply)[0].as_object().unwrap().len(), 1);
}

/// A directory of this test process's own, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("shoal-repl-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Waits for `marker` to exist: the cell that makes it has started (its
/// output is the cell's, captured, so it cannot be read before the reply).
fn wait_for_marker(marker: &Path) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !marker.exists() {
        assert!(
            Instant::now() < deadline,
            "the cell never wrote {}",
            marker.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn sigint_interrupts_a_cell_and_is_ignored_between_cells() {
    let mut k = Kernel::start();
    let scratch = Scratch::new("sigint");
    k.run("counter = 1");
    // Between cells: ignored.
    k.sigint();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(k.value("counter"), "1");
    for (n, body) in [
        "while True:\n    counter += 1",
        "import time\ntime.sleep(60)",
    ]
    .into_iter()
    .enumerate()
    {
        // A SIGINT before the cell runs would be ignored (between cells) and
        // the cell would never end: interrupt only once it has started.
        let marker = scratch.path().join(format!("started-{n}"));
        let code = format!("open({:?}, 'w').close()\n{body}", marker.to_str().unwrap());
        let id = k.send(&code);
        wait_for_marker(&marker);
        k.sigint();
        let reply = k.read_line_within(Duration::from_secs(30));
        assert_eq!(reply["id"], json!(id));
        assert_eq!(reply["exit_code"], 1);
        let error = reply["error"].as_str().unwrap();
        assert!(error.ends_with("KeyboardInterrupt"), "{error}");
        assert!(!error.contains("_on_sigint"), "{error}");
    }
    assert_eq!(k.value("counter > 1"), "True");
}

#[test]
fn bad_requests_are_rejected_and_the_kernel_goes_on() {
    let mut k = Kernel::start();
    k.stdin.write_all(b"not json\n\0\n{\"code\": 5}\n").unwrap();
    for _ in 0..3 {
        let reply = k.read_line();
        assert_eq!(reply["id"], Value::Null);
        assert!(reply["protocol_error"].is_string(), "{reply}");
    }
    assert_eq!(k.value("'fine'"), "'fine'");
}

#[test]
fn a_dataframe_has_an_html_table() {
    if !have_scientific_stack() {
        return;
    }
    let mut k = Kernel::start();
    let reply = k.run("import pandas as pd\ndf = pd.DataFrame({'a': [1, 2], 'b': [3, 4]})\ndf");
    assert_eq!(reply["exit_code"], 0, "{reply}");
    let bundle = &results(&reply)[0];
    assert!(bundle["text/plain"].as_str().unwrap().contains('a'));
    assert!(
        bundle["text/html"].as_str().unwrap().contains("<table"),
        "{bundle}"
    );
}

#[test]
fn matplotlib_figures_become_pngs_once_and_are_closed() {
    if !have_scientific_stack() {
        return;
    }
    let mut k = Kernel::start();
    let reply = k.run("import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()");
    assert_eq!(reply["exit_code"], 0, "{reply}");
    assert_eq!(reply["stderr"], "", "plt.show() does not warn");
    let figures = results(&reply);
    assert_eq!(figures.len(), 1, "{reply}");
    let png = base64_decode(figures[0]["image/png"].as_str().unwrap());
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"));
    assert!(png.len() > 1000);
    assert!(figures[0]["text/plain"]
        .as_str()
        .unwrap()
        .starts_with("<Figure size"));

    // Closed after the cell: the next one has no figure.
    assert!(results(&k.run("1 and None")).is_empty());

    // A figure as the last expression is reported once; other open figures
    // follow it.
    let reply = k.run("fig = plt.figure()\nplt.plot([1])\nplt.figure()\nplt.plot([2])\nfig");
    let figures = results(&reply);
    assert_eq!(figures.len(), 2, "{reply}");
    assert!(figures.iter().all(|f| f.get("image/png").is_some()));

    // Figures of a cell that raised are still reported.
    let reply = k.run("plt.plot([1])\n1/0");
    assert_eq!(reply["exit_code"], 1);
    assert_eq!(results(&reply).len(), 1);
}
