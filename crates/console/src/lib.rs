//! The web console (issue 25): `GET /` and `GET /console/{path}`, static
//! files embedded in the binary at build time (`build.rs` walks `assets/`).
//!
//! Owns: the page, its scripts and styles, the vendored browser libraries
//! (`assets/vendor/`, copied from the npm registry by
//! `scripts/vendor-console` at the versions `package-lock.json` pins), and
//! the headers that keep the page from being framed or fed foreign scripts.
//!
//! May not touch: the API. The page is a client of the public `/v1` routes,
//! signed in with an API token it keeps in the browser's session storage and
//! sends as the bearer token; this crate has no state, no database handle,
//! no cookies and no route under `/v1`, so an API request never passes
//! through it and the SDK's paths stay as they were.

use axum::body::Body;
use axum::extract::Path;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use std::path::PathBuf;

/// `(path under assets/, contents)`, written by `build.rs`.
static ASSETS: &[(&str, &[u8])] = include!(concat!(env!("OUT_DIR"), "/assets.rs"));

/// Scripts and styles from this origin only; the API (and the terminal's
/// WebSocket) on this origin only; never inside another site's frame.
/// Inline styles are allowed because xterm.js and uPlot set them.
const CONTENT_SECURITY_POLICY: &str = "default-src 'self'; script-src 'self'; \
     style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; connect-src 'self'; \
     font-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; \
     frame-ancestors 'none'";

/// The console's routes, to merge into a server's router. With
/// `SHOAL_CONSOLE_DIR` set (a developer's checkout of `assets/`), files are
/// read from there at each request instead, so the page can be edited
/// without rebuilding the binary.
pub fn router<S: Clone + Send + Sync + 'static>() -> Router<S> {
    let dev_dir = std::env::var_os("SHOAL_CONSOLE_DIR").map(PathBuf::from);
    let index_dir = dev_dir.clone();
    Router::new()
        .route(
            "/",
            get(move || {
                let dir = index_dir.clone();
                async move { serve("index.html", dir.as_ref()) }
            }),
        )
        .route(
            "/console/{*path}",
            get(move |Path(path): Path<String>| {
                let dir = dev_dir.clone();
                async move { serve(&path, dir.as_ref()) }
            }),
        )
}

/// The embedded file at `path`, if there is one.
pub fn asset(path: &str) -> Option<&'static [u8]> {
    ASSETS
        .iter()
        .find(|(name, _)| *name == path)
        .map(|(_, bytes)| *bytes)
}

/// Every embedded file's path.
pub fn asset_paths() -> impl Iterator<Item = &'static str> {
    ASSETS.iter().map(|(name, _)| *name)
}

fn serve(path: &str, dev_dir: Option<&PathBuf>) -> Response {
    let bytes: Option<Vec<u8>> = match dev_dir {
        Some(dir) if is_plain_relative(path) => std::fs::read(dir.join(path)).ok(),
        Some(_) => None,
        None => asset(path).map(<[u8]>::to_vec),
    };
    let Some(bytes) = bytes else {
        return (StatusCode::NOT_FOUND, "no such console file").into_response();
    };
    let mut response = Response::new(Body::from(bytes));
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(content_type(path)),
    );
    // Assets change with the binary; a reload after an upgrade must not
    // mix old scripts with a new page.
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    response
}

/// No `..`, no absolute path, no empty segment: a developer's directory is
/// served, not what lies around it.
fn is_plain_relative(path: &str) -> bool {
    !path.is_empty()
        && path
            .split('/')
            .all(|segment| !segment.is_empty() && segment != "." && segment != "..")
}

fn content_type(path: &str) -> &'static str {
    match path.rsplit_once('.').map(|(_, ext)| ext) {
        Some("html") => "text/html; charset=utf-8",
        Some("js" | "mjs") => "text/javascript; charset=utf-8",
        Some("css") => "text/css; charset=utf-8",
        Some("svg") => "image/svg+xml",
        Some("png") => "image/png",
        Some("json") => "application/json",
        _ => "text/plain; charset=utf-8",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::Request;
    use sha2::{Digest, Sha256};
    use tower::ServiceExt;

    async fn get_path(path: &str) -> Response {
        router::<()>()
            .oneshot(Request::get(path).body(Body::empty()).unwrap())
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn the_page_and_its_assets_are_served_with_their_types_and_guards() {
        let page = get_path("/").await;
        assert_eq!(page.status(), StatusCode::OK);
        assert_eq!(
            page.headers()[header::CONTENT_TYPE],
            "text/html; charset=utf-8"
        );
        assert!(page.headers()[header::CONTENT_SECURITY_POLICY]
            .to_str()
            .unwrap()
            .contains("frame-ancestors 'none'"));
        assert_eq!(page.headers()[header::X_FRAME_OPTIONS], "DENY");
        for path in asset_paths() {
            let answer = get_path(&format!("/console/{path}")).await;
            assert_eq!(answer.status(), StatusCode::OK, "{path}");
        }
        let script = get_path("/console/vendor/xterm.mjs").await;
        assert_eq!(
            script.headers()[header::CONTENT_TYPE],
            "text/javascript; charset=utf-8"
        );
    }

    #[tokio::test]
    async fn unknown_and_escaping_paths_are_404() {
        for path in [
            "/console/nope.js",
            "/console/../Cargo.toml",
            "/console/%2e%2e/Cargo.toml",
            "/console/vendor",
        ] {
            assert_eq!(
                get_path(path).await.status(),
                StatusCode::NOT_FOUND,
                "{path}"
            );
        }
        assert!(!is_plain_relative("../x"));
        assert!(!is_plain_relative("/etc/passwd"));
        assert!(!is_plain_relative("a//b"));
        assert!(is_plain_relative("vendor/xterm.mjs"));
    }

    /// The vendored files are the ones `scripts/vendor-console` copied from
    /// the packages `package-lock.json` pins: each is listed in the
    /// manifest with its package, version, registry integrity and hash.
    #[test]
    fn vendored_files_match_the_manifest_and_the_lockfile() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let lock: String = std::fs::read_to_string(root.join("package-lock.json")).unwrap();
        let manifest = std::str::from_utf8(asset("vendor/MANIFEST").unwrap()).unwrap();
        let vendored: Vec<&str> = asset_paths()
            .filter(|p| p.starts_with("vendor/") && *p != "vendor/MANIFEST")
            .collect();
        assert!(vendored.len() >= 5, "{vendored:?}");
        for path in vendored {
            let name = path.trim_start_matches("vendor/");
            let line = manifest
                .lines()
                .find(|l| l.split(' ').next() == Some(name))
                .unwrap_or_else(|| panic!("{name} is not in vendor/MANIFEST"));
            let fields: Vec<&str> = line.split(' ').collect();
            let (package, version) = fields[1].rsplit_once('@').unwrap();
            let locked =
                format!("\"node_modules/{package}\": {{\n      \"version\": \"{version}\"");
            assert!(
                lock.contains(&locked),
                "{package}@{version} is not what package-lock.json pins"
            );
            assert!(
                lock.contains(fields[2]),
                "{package}'s integrity is not the lockfile's"
            );
            let digest = hex::encode(Sha256::digest(asset(path).unwrap()));
            assert_eq!(
                fields[3],
                format!("sha256:{digest}"),
                "{name} changed since it was vendored"
            );
        }
    }
}
