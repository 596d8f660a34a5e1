//! Steady traffic, for the tests that change the datapath under it (an owner restart, an
//! upgrade, a takeover): a client connecting again and again, each connection logged with when
//! it ran and what it got, so a test can tell which ones ran while the change happened.
//!
//! A loop rests as long as its last connection took before the next: connections keep coming
//! at whatever pace the machine allows, while the change under test (an agent starting, in an
//! emulated guest) gets half the CPU the loop would otherwise take.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::sockopt::canonical;
use crate::wait::wait_until;
use crate::{tcp_request, NetNs};

/// How long a loop may take for the connections a test waits for: a deadline for loops that
/// stopped, not a speed, since under an emulated CPU (the kernel VMs) with the other tests running
/// a phase's connections have taken more than 10 s.
const STALLED: Duration = Duration::from_secs(60);

/// One connection of a traffic loop.
#[derive(Debug)]
pub struct Connection {
    pub started: Instant,
    pub finished: Instant,
    /// The client's address (canonical) when the app's answer came back from the target the
    /// client connected to; what went wrong otherwise.
    pub outcome: Result<SocketAddr, String>,
}

/// A thread in a namespace connecting to one target until stopped.
pub struct TrafficLoop {
    log: Arc<Mutex<Vec<Connection>>>,
    stop: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

impl TrafficLoop {
    /// Connects to `target` from inside `netns` again and again (see the module's doc), expecting
    /// the answer `expected`.
    pub fn start(netns: &NetNs, target: SocketAddr, expected: String) -> Self {
        let log: Arc<Mutex<Vec<Connection>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (log, stop) = (log.clone(), stop.clone());
            netns
                .spawn("traffic", move || {
                    while !stop.load(Ordering::Relaxed) {
                        let started = Instant::now();
                        let outcome = match tcp_request(target, "loop") {
                            Ok(reply) if reply.peer_seen_by_client != target => Err(format!(
                                "the client was connected to {}",
                                reply.peer_seen_by_client
                            )),
                            Ok(reply) if reply.response == expected => Ok(canonical(reply.local)),
                            Ok(reply) => Err(format!("answered {:?}", reply.response)),
                            Err(error) => Err(error.to_string()),
                        };
                        let finished = Instant::now();
                        log.lock().unwrap().push(Connection {
                            started,
                            finished,
                            outcome,
                        });
                        std::thread::sleep(finished - started);
                    }
                })
                .expect("the traffic thread")
        };
        Self { log, stop, thread }
    }

    /// The connections so far.
    pub fn connections(&self) -> MutexGuard<'_, Vec<Connection>> {
        self.log.lock().unwrap()
    }

    /// Stops the loop after its connection in flight; returns every connection it made.
    pub fn stop(self) -> Vec<Connection> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().expect("traffic loop");
        std::mem::take(&mut *self.log.lock().unwrap())
    }
}

/// Waits until `count` connections of each loop started after `since`.
pub fn wait_for_connections(loops: &[&TrafficLoop], since: Instant, count: usize) {
    let what = format!("{count} connections of each traffic loop after {since:?}");
    wait_until(STALLED, &what, || {
        loops.iter().all(|traffic| {
            let log = traffic.connections();
            log.iter().filter(|c| c.started > since).count() >= count
        })
    });
}
