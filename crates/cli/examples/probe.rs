//! Latency probe: where an exec round trip goes (scratch tool, not shipped).
use shoal_engine::{Engine, EngineConfig};
use shoal_proto::client::ExecRequest;
use std::time::Instant;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).init();
    let template = std::env::args().nth(1).unwrap_or("code-interpreter".into());
    let engine = Engine::open(EngineConfig::new("/var/lib/shoal")).await?;
    for _ in 0..std::env::var("NC").ok().and_then(|v| v.parse().ok()).unwrap_or(5) {
        let t = Instant::now();
        let sb = engine.create(&template, None).await?;
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", sb.pid.unwrap())).unwrap();
        let f: Vec<&str> = stat.rsplit(')').next().unwrap().split_whitespace().collect();
        let cpu = (f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap()) * 10.0;
        let thr = std::fs::read_dir(format!("/proc/{}/task", sb.pid.unwrap())).unwrap().count();
        println!("create {:.1} qemu cpu {cpu} ms, threads {thr}", t.elapsed().as_secs_f64() * 1e3);
        engine.kill(&sb.id).await?;
    }
    let t = Instant::now();
    let sb = engine.create(&template, None).await?;
    println!("create {:.1}", t.elapsed().as_secs_f64() * 1e3);
    let agent = engine.agent(&sb.id).await?;
    if let Ok(n) = std::env::var("FORK") {
        let agent = engine.agent(&sb.id).await?;
        agent.exec_collect(ExecRequest { cmd: "nohup python3 -c 'import time\nn=0\nwhile True:\n    n+=1\n    time.sleep(0.01)' >/dev/null 2>&1 &".into(), ..Default::default() }).await?;
        for _ in 0..3 {
            let t = Instant::now();
            let fork = engine.fork(&sb.id, n.parse()?).await?;
            let mut r: Vec<f64> = fork.children.iter().map(|c| c.restore_ms).collect();
            r.sort_by(|a, b| a.partial_cmp(b).unwrap());
            println!("fork all {:.0} capture {:.0} restore min {:.0} max {:.0}", t.elapsed().as_secs_f64()*1e3, fork.capture_ms, r[0], r[r.len()-1]);
            for c in fork.children { engine.kill(&c.id).await?; }
        }
    }
    let extra: Vec<String> = std::env::args().skip(2).collect();
    for c in &extra {
        let r = agent.exec_collect(ExecRequest { cmd: c.clone(), ..Default::default() }).await?;
        println!("$ {c}\n{}{}", String::from_utf8_lossy(&r.stdout), String::from_utf8_lossy(&r.stderr));
    }
    for cmd in ["true", "/bin/true", "exit 0", "echo hi"] {
        let mut v = vec![];
        for _ in 0..20 {
            let t = Instant::now();
            let r = agent.exec_collect(ExecRequest { cmd: cmd.into(), ..Default::default() }).await?;
            assert_eq!(r.status.code, Some(0));
            v.push(t.elapsed().as_secs_f64() * 1e3);
            if std::env::var("GAP").is_ok() { tokio::time::sleep(std::time::Duration::from_millis(std::env::var("GAP").unwrap().parse().unwrap())).await; }
        }
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        println!("{cmd:10} p50 {:.1} min {:.1}", v[10], v[0]);
    }
    let mut v = vec![];
    for _ in 0..20 {
        let t = Instant::now();
        agent.ping().await?;
        v.push(t.elapsed().as_secs_f64() * 1e3);
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    println!("ping p50 {:.1} min {:.1}", v[10], v[0]);
    engine.kill(&sb.id).await?;
    Ok(())
}
