//! Health and metrics over HTTP, as istio-cni serves them: `/healthz` (liveness), `/readyz`
//! (installed and serving) and `/metrics` (Prometheus text format).
use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
};

use anyhow::{Context, Result};
use axum::{extract::State, http::StatusCode, response::IntoResponse, routing::get, Router};
use prometheus_client::{encoding::text::encode, registry::Registry};
use tokio::sync::watch;

#[derive(Clone)]
struct Shared {
    ready: watch::Receiver<bool>,
    registry: Arc<Mutex<Registry>>,
}

/// Serves until the task is dropped. `ready` says whether the node is installed and serving.
pub async fn serve(
    addr: SocketAddr,
    ready: watch::Receiver<bool>,
    registry: Arc<Mutex<Registry>>,
) -> Result<()> {
    let app = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(Shared { ready, registry });
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    tracing::info!(addr = %listener.local_addr()?, "serving /healthz /readyz /metrics");
    axum::serve(listener, app).await.context("http server")
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
