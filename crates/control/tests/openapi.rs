//! The OpenAPI document and the router describe the same API: every
//! documented operation is routed, no undocumented method is, and the
//! router has no path the document lacks.

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use tower::ServiceExt;

const METHODS: [&str; 5] = ["GET", "POST", "PUT", "PATCH", "DELETE"];

#[tokio::test]
async fn the_document_and_the_router_agree() {
    let doc: serde_json::Value = serde_json::from_str(shoal_control::OPENAPI).unwrap();
    let paths = doc["paths"].as_object().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let store = shoal_store::Store::connect(dir.path().join("shoal.db").to_str().unwrap())
        .await
        .unwrap();
    let host = shoal_host::HostAgent::open(shoal_host::HostConfig {
        engine: shoal_host::EngineConfig::new(dir.path().join("state")),
        max_sandboxes: None,
        memory_reserve_mib: 0,
        memory_overcommit: shoal_host::DEFAULT_MEMORY_OVERCOMMIT,
        disk_reserve_mib: 0,
        guest_agent: None,
    })
    .await
    .unwrap();
    let control = shoal_control::ControlPlane::new(store, host, Default::default());
    let router = shoal_control::router(control);
    for (path, ops) in paths {
        let concrete = path
            .replace("{id}", "sb-000000000000")
            .replace("{session_id}", "ctx-0")
            .replace("{index}", "0")
            .replace("{port}", "8000")
            .replace("{path}", "index.html")
            .replace(
                "{digest}",
                "0000000000000000000000000000000000000000000000000000000000000000",
            );
        for method in METHODS {
            let documented = ops.get(method.to_lowercase()).is_some();
            let request = Request::builder()
                .method(Method::from_bytes(method.as_bytes()).unwrap())
                .uri(&concrete)
                .body(Body::empty())
                .unwrap();
            let status = router.clone().oneshot(request).await.unwrap().status();
            let routed =
                status != StatusCode::METHOD_NOT_ALLOWED && status != StatusCode::NOT_FOUND;
            assert_eq!(
                routed, documented,
                "{method} {path}: router answered {status}"
            );
        }
    }
    // The web console is served beside the API, not part of it.
    for page in ["/", "/console/index.html"] {
        let request = Request::get(page).body(Body::empty()).unwrap();
        let answer = router.clone().oneshot(request).await.unwrap();
        assert_eq!(answer.status(), StatusCode::OK, "{page}");
        assert!(answer.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/html"));
    }
    let source = include_str!("../src/lib.rs");
    assert_eq!(
        source.matches("        .route(").count(),
        paths.len(),
        "the router has a path the document does not list"
    );
}
