//! Health and metrics over HTTP, as istio-cni serves them: `/healthz` (liveness), `/readyz`
//! (installed and serving) and `/metrics` (Prometheus text format).
use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::{Context, Result};
use axum::{extract::State, http::StatusCode, response::IntoResponse, routing::get, Router};
use hyper::server::conn::http1;
use hyper_util::{
    rt::{TokioIo, TokioTimer},
    service::TowerToHyperService,
};
use prometheus_client::{encoding::text::encode, registry::Registry};
use tokio::sync::{watch, Semaphore};

#[derive(Clone)]
struct Shared {
    ready: watch::Receiver<bool>,
    live: Liveness,
    registry: Arc<Mutex<Registry>>,
}

/// A client that has not sent a request's headers this long after connecting (or after the
/// previous response) is dropped: pods can reach these ports, and an idle connection must not
/// hold a task and a socket forever.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// No connection lives longer, whatever it does: a scrape or a probe takes milliseconds.
const MAX_CONNECTION_TIME: Duration = Duration::from_secs(60);
/// Connections served at once; more wait in the listen backlog.
const MAX_CONNECTIONS: usize = 128;

/// Serves until the task is dropped. `ready` says whether the node is installed and serving;
/// `live` whether the agent's long-running parts are alive (`/healthz`).
pub async fn serve(
    addr: SocketAddr,
    ready: watch::Receiver<bool>,
    live: Liveness,
    registry: Arc<Mutex<Registry>>,
) -> Result<()> {
    let app = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(Shared {
            ready,
            live,
            registry,
        });
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    tracing::info!(addr = %listener.local_addr()?, "serving /healthz /readyz /metrics");
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let slot = slots.clone().acquire_owned().await?;
        let (stream, _) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                // EMFILE and the like pass; the listener stays.
                tracing::warn!(%error, "accepting an http connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let service = TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let connection = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service);
            let _ = tokio::time::timeout(MAX_CONNECTION_TIME, connection).await;
            drop(slot);
        });
    }
}

/// Whether the agent's long-running parts are alive: `Err` names the one that is not.
pub type Liveness = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

async fn healthz(State(shared): State<Shared>) -> impl IntoResponse {
    match (shared.live)() {
        Ok(()) => (StatusCode::OK, "ok\n".to_owned()),
        Err(dead) => (StatusCode::SERVICE_UNAVAILABLE, format!("{dead}\n")),
    }
}

async fn readyz(State(shared): State<Shared>) -> impl IntoResponse {
    if *shared.ready.borrow() {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
    }
}

async fn metrics(State(shared): State<Shared>) -> impl IntoResponse {
    let mut body = String::new();
    match encode(&mut body, &shared.registry.lock().unwrap()) {
        Ok(()) => (
            StatusCode::OK,
            [(
                axum::http::header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            body,
        )
            .into_response(),
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response(),
    }
}
