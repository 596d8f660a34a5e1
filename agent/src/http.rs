//! Health and metrics over HTTP, as istio-cni serves them: `/healthz` (liveness) and `/readyz`
//! (installed and serving) on the health address, `/metrics` (Prometheus text format) on the
//! metrics address. Both are on the node's network, where every pod can reach them. `/logging`
//! (the log filter, shown and changed as ztunnel's admin port does) is on the admin address, on
//! the node's loopback: what only someone on the node may do.
use std::{
    collections::{HashMap, VecDeque},
    net::{IpAddr, SocketAddr},
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::{Context, Result};
use axum::{
    extract::State,
    http::{StatusCode, Uri},
    response::{IntoResponse, Response},
    routing::get,
    Router,
};
use hyper::server::conn::http1;
use hyper_util::{
    rt::{TokioIo, TokioTimer},
    service::TowerToHyperService,
};
use prometheus_client::{encoding::text::encode, registry::Registry};
use tokio::sync::{oneshot, watch};

use crate::logging;

#[derive(Clone)]
struct Health {
    ready: watch::Receiver<bool>,
    live: Liveness,
}

#[derive(Clone)]
struct Scrapes {
    registry: Arc<Mutex<Registry>>,
    /// Held for the whole of a scrape.
    turn: Arc<tokio::sync::Mutex<()>>,
}

/// A client that has not sent a request's headers this long after connecting (or after the
/// previous response) is dropped: pods can reach these ports, and an idle connection must not
/// hold a task and a socket forever.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// No connection lives longer, whatever it does: a scrape or a probe takes milliseconds.
const MAX_CONNECTION_TIME: Duration = Duration::from_secs(60);
/// Connections served at once on each address; past this a newcomer takes the slot of another
/// (see [`Connections`]).
const MAX_CONNECTIONS: usize = 128;

/// Serves the probes' paths, and only them, until the task is dropped. `ready` says whether the
/// node is installed and serving; `live` whether the agent's long-running parts are alive
/// (`/healthz`). Every pod reaches this address, kubelet's probes among them: it tells nothing
/// of the node's pods.
pub async fn serve_health(
    addr: SocketAddr,
    ready: watch::Receiver<bool>,
    live: Liveness,
) -> Result<()> {
    serve_routes(addr, health_routes(ready, live), "/healthz /readyz").await
}

/// Serves `/metrics` from `registry`, per-pod series included, until the task is dropped; and
/// the probes' paths too, as [`serve_health`] does, so a scraper can tell a dead agent from an
/// empty one at the address it already has.
pub async fn serve(
    addr: SocketAddr,
    ready: watch::Receiver<bool>,
    live: Liveness,
    registry: Arc<Mutex<Registry>>,
) -> Result<()> {
    let scrapes = Router::new()
        .route("/metrics", get(metrics))
        .with_state(Scrapes {
            registry,
            turn: Default::default(),
        });
    let routes = health_routes(ready, live).merge(scrapes);
    serve_routes(addr, routes, "/healthz /readyz /metrics").await
}

/// Serves `/logging` until the task is dropped: `GET` shows the log filter in force, `POST
/// /logging?level=<filter>` (`RUST_LOG`'s syntax, e.g. `debug` or
/// `info,weir_agent::datapath=debug`) puts another in force; an invalid one is refused (400) and
/// changes nothing. `addr` is meant to be loopback: anyone who reaches it can fill the node's
/// logs. `GET /logs` answers the agent's last lines ([`logging::recent_lines`]), for
/// `weir-agent bug-report`.
pub async fn serve_admin(addr: SocketAddr) -> Result<()> {
    let routes = Router::new()
        .route("/logging", get(show_log_filter).post(set_log_filter))
        .route("/logs", get(recent_logs));
    serve_routes(addr, routes, "/logging /logs").await
}

async fn recent_logs() -> String {
    logging::recent_lines()
        .into_iter()
        .flat_map(|line| [line, "\n".to_owned()])
        .collect()
}

/// Binds `addr`, waiting while another process holds it: the node agent weir takes a node over
/// from (istio-cni's) serves the same ports until it leaves the node.
async fn bind_when_free(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let mut told = false;
    loop {
        match tokio::net::TcpListener::bind(addr).await {
            Err(error) if error.kind() == std::io::ErrorKind::AddrInUse => {
                if !std::mem::replace(&mut told, true) {
                    tracing::warn!(
                        %addr,
                        "the port is in use (by istio-cni's node agent, leaving the node?): \
                         serving there once it is free"
                    );
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            bound => return bound,
        }
    }
}

fn health_routes(ready: watch::Receiver<bool>, live: Liveness) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(Health { ready, live })
}

async fn serve_routes(addr: SocketAddr, routes: Router, paths: &str) -> Result<()> {
    let listener = bind_when_free(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    tracing::info!(addr = %listener.local_addr()?, "serving {paths}");
    let mut connections = Connections::default();
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                // EMFILE and the like pass; the listener stays.
                tracing::warn!(%error, "accepting an http connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let displaced = connections.admit(peer.ip());
        let service = TowerToHyperService::new(routes.clone());
        tokio::spawn(async move {
            let connection = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                _ = tokio::time::timeout(MAX_CONNECTION_TIME, connection) => {}
                _ = displaced => {}
            }
        });
    }
}

/// The connections being served, oldest first, by peer address. Were newcomers to wait for a
/// free slot, idle clients could hold every one and leave kubelet's probe unanswered in the
/// listen backlog. Instead a newcomer is always served: when all slots are taken it gets the
/// slot of the oldest connection of the peer that holds the most, so a pod that floods the
/// port displaces its own connections before anyone else's.
#[derive(Default)]
struct Connections {
    by_peer: HashMap<IpAddr, VecDeque<oneshot::Sender<()>>>,
}

impl Connections {
    /// A slot for a connection from `peer`: the connection is to close once the returned
    /// receiver resolves, its slot given to a newcomer.
    fn admit(&mut self, peer: IpAddr) -> oneshot::Receiver<()> {
        // A connection that ended dropped its receiver.
        self.by_peer.retain(|_, open| {
            open.retain(|slot| !slot.is_closed());
            !open.is_empty()
        });
        let served: usize = self.by_peer.values().map(VecDeque::len).sum();
        if served >= MAX_CONNECTIONS {
            let busiest = self.by_peer.values_mut().max_by_key(|open| open.len());
            // Dropping its sender resolves its receiver.
            drop(busiest.and_then(VecDeque::pop_front));
        }
        let (slot, displaced) = oneshot::channel();
        self.by_peer.entry(peer).or_default().push_back(slot);
        displaced
    }
}

/// Whether the agent's long-running parts are alive: `Err` names the one that is not.
pub type Liveness = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

async fn healthz(State(health): State<Health>) -> impl IntoResponse {
    match (health.live)() {
        Ok(()) => (StatusCode::OK, "ok\n".to_owned()),
        Err(dead) => (StatusCode::SERVICE_UNAVAILABLE, format!("{dead}\n")),
    }
}

async fn readyz(State(health): State<Health>) -> impl IntoResponse {
    if *health.ready.borrow() {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
    }
}

async fn show_log_filter() -> (StatusCode, String) {
    match logging::log_filter() {
        Some(filter) => (StatusCode::OK, current_filter(&filter.current())),
        None => filter_not_adjustable(),
    }
}

async fn set_log_filter(uri: Uri) -> (StatusCode, String) {
    let Some(filter) = logging::log_filter() else {
        return filter_not_adjustable();
    };
    let query = uri.query().unwrap_or_default();
    let Some((_, level)) = form_urlencoded::parse(query.as_bytes()).find(|(key, _)| key == "level")
    else {
        return (
            StatusCode::BAD_REQUEST,
            "no level: POST /logging?level=<filter>, e.g. level=debug or \
             level=info,weir_agent::datapath=debug\n"
                .to_owned(),
        );
    };
    let before = filter.current();
    match filter.set(&level) {
        Ok(now) => {
            tracing::info!(before, now, "log filter changed");
            (StatusCode::OK, current_filter(&now))
        }
        Err(invalid) => (
            StatusCode::BAD_REQUEST,
            format!("{invalid}; the log filter stays {before}\n"),
        ),
    }
}

fn current_filter(filter: &str) -> String {
    format!("current log level is {filter}\n")
}

/// A process whose logger is not weir's (the agent run inside a test) has no filter to change.
fn filter_not_adjustable() -> (StatusCode, String) {
    (
        StatusCode::NOT_IMPLEMENTED,
        "this process's log filter cannot be changed\n".to_owned(),
    )
}

/// Encodes on a blocking thread: collectors read the pinned maps pod by pod, under a blocking
/// lock, and on an async worker a slow scrape would hold up the CNI and ZDS work that shares the
/// runtime. One scrape at a time: the ones that come meanwhile wait here for their turn rather
/// than each take a blocking thread.
async fn metrics(State(scrapes): State<Scrapes>) -> Response {
    let turn = scrapes.turn.clone().lock_owned().await;
    let registry = scrapes.registry.clone();
    let encoded = tokio::task::spawn_blocking(move || {
        // Held until the encoding is done, even when the client has gone meanwhile.
        let _turn = turn;
        let mut body = String::new();
        encode(&mut body, &registry.lock().unwrap()).map(|()| body)
    })
    .await;
    let error = match encoded {
        Ok(Ok(body)) => {
            return (
                StatusCode::OK,
                [(
                    axum::http::header::CONTENT_TYPE,
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                )],
                body,
            )
                .into_response()
        }
        Ok(Err(error)) => error.to_string(),
        Err(error) => error.to_string(),
    };
    (StatusCode::INTERNAL_SERVER_ERROR, error).into_response()
}

#[cfg(test)]
mod tests {
    use std::{
        io::{Read, Write},
        net::TcpStream,
        sync::{
            atomic::{AtomicUsize, Ordering},
            Condvar,
        },
        time::Instant,
    };

    use prometheus_client::{collector::Collector, encoding::DescriptorEncoder};

    use super::*;

    /// Where a [`SlowCollector`] waits, and how many scrapes are inside it.
    #[derive(Debug, Default)]
    struct Gate {
        open: Mutex<bool>,
        opened: Condvar,
        inside: AtomicUsize,
        most_inside: AtomicUsize,
    }

    /// A collector whose reads block until its gate opens, as per-pod reads do on a slow node.
    #[derive(Debug)]
    struct SlowCollector(Arc<Gate>);

    impl Collector for SlowCollector {
        fn encode(&self, _: DescriptorEncoder) -> Result<(), std::fmt::Error> {
            let gate = &self.0;
            let inside = gate.inside.fetch_add(1, Ordering::SeqCst) + 1;
            gate.most_inside.fetch_max(inside, Ordering::SeqCst);
            // Bounded, so that a server that blocks its runtime fails the test rather than hang it.
            let open = gate.open.lock().unwrap();
            drop(
                gate.opened
                    .wait_timeout_while(open, Duration::from_secs(10), |open| !*open)
                    .unwrap(),
            );
            gate.inside.fetch_sub(1, Ordering::SeqCst);
            Ok(())
        }
    }

    /// With every slot taken, the peer that holds the most gives up its oldest connection: a pod
    /// flooding the port displaces its own connections, never kubelet's probe from elsewhere.
    #[test]
    fn a_newcomer_displaces_the_oldest_connection_of_the_busiest_peer() {
        use tokio::sync::oneshot::error::TryRecvError;
        let flooder: IpAddr = "10.244.0.5".parse().unwrap();
        let mut connections = Connections::default();
        let mut probe = connections.admit("10.0.0.1".parse().unwrap());
        let mut flood: Vec<_> = (0..2 * MAX_CONNECTIONS)
            .map(|_| connections.admit(flooder))
            .collect();
        assert_eq!(probe.try_recv(), Err(TryRecvError::Empty), "the probe");
        let served: Vec<bool> = flood
            .iter_mut()
            .map(|connection| connection.try_recv() == Err(TryRecvError::Empty))
            .collect();
        let newest = 2 * MAX_CONNECTIONS - (MAX_CONNECTIONS - 1);
        assert!(served[..newest].iter().all(|served| !served), "the oldest");
        assert!(served[newest..].iter().all(|served| *served), "the newest");

        // Connections that ended free their slots: nobody is displaced until all are taken again.
        flood.clear();
        let mut next = connections.admit(flooder);
        assert_eq!(probe.try_recv(), Err(TryRecvError::Empty));
        assert_eq!(next.try_recv(), Err(TryRecvError::Empty));
    }

    /// The status of a plain HTTP/1.0 GET, retried while the server is not yet listening.
    fn status(addr: SocketAddr, path: &str) -> std::io::Result<u16> {
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut stream = loop {
            match TcpStream::connect(addr) {
                Ok(stream) => break stream,
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Err(error) => return Err(error),
            }
        };
        stream.set_read_timeout(Some(Duration::from_secs(2)))?;
        write!(stream, "GET {path} HTTP/1.0\r\n\r\n")?;
        let mut response = String::new();
        stream.read_to_string(&mut response)?;
        response
            .split_whitespace()
            .nth(1)
            .and_then(|code| code.parse().ok())
            .ok_or_else(|| std::io::Error::other(format!("no status in {response:?}")))
    }

    /// With one async worker, as a busy runtime may have: a scrape stuck in a collector holds
    /// up neither the probes nor anything else on the runtime, and the scrapes that come
    /// meanwhile wait their turn rather than each take a thread.
    #[test]
    fn a_slow_scrape_blocks_no_async_worker_and_scrapes_run_one_at_a_time() {
        let gate = Arc::new(Gate::default());
        let mut registry = Registry::default();
        registry.register_collector(Box::new(SlowCollector(gate.clone())));
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let (_ready_tx, ready) = watch::channel(true);
        let live: Liveness = Arc::new(|| Ok(()));
        let server = serve(addr, ready, live, Arc::new(Mutex::new(registry)));
        std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(server)
        });
        let scrapes: Vec<_> = (0..3)
            .map(|_| std::thread::spawn(move || status(addr, "/metrics")))
            .collect();
        let deadline = Instant::now() + Duration::from_secs(5);
        while gate.inside.load(Ordering::SeqCst) == 0 {
            assert!(Instant::now() < deadline, "no scrape reached the collector");
            std::thread::sleep(Duration::from_millis(10));
        }

        assert_eq!(status(addr, "/healthz").unwrap(), 200, "during a scrape");
        *gate.open.lock().unwrap() = true;
        gate.opened.notify_all();
        for scrape in scrapes {
            assert_eq!(scrape.join().unwrap().unwrap(), 200);
        }
        assert_eq!(gate.most_inside.load(Ordering::SeqCst), 1);
    }
}
