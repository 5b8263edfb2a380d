//! A sandbox of a test binary's engine that is killed when the test ends,
//! pass or fail.

use shoal_engine::{CreateOptions, Engine};
use shoal_proto::client::AgentClient;

pub struct Sandbox {
    engine: &'static Engine,
    pub id: String,
}

impl Sandbox {
    /// Takes charge of sandbox `id` (a fork child, a restore).
    pub fn adopt(engine: &'static Engine, id: impl Into<String>) -> Sandbox {
        Sandbox {
            engine,
            id: id.into(),
        }
    }

    pub async fn create(
        engine: &'static Engine,
        template: &str,
        options: CreateOptions,
    ) -> Sandbox {
        let info = engine
            .create_with(template, None, options)
            .await
            .unwrap_or_else(|e| {
                panic!("create from {template}: {}", shoal_engine::error::chain(&e))
            });
        Sandbox::adopt(engine, info.id)
    }

    pub async fn agent(&self) -> AgentClient {
        self.engine.agent(&self.id).await.expect("agent")
    }

    /// Its QEMU's pid.
    pub async fn pid(&self) -> u32 {
        self.engine
            .get(&self.id)
            .await
            .expect("get")
            .pid
            .expect("a live QEMU")
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        let (engine, id) = (self.engine, self.id.clone());
        // A thread of its own: the test may be inside `block_on` already.
        std::thread::spawn(move || {
            let _ = crate::runtime().block_on(engine.kill(&id));
        })
        .join()
        .ok();
    }
}
