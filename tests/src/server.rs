//! The serving loop shared by the echo servers and the ztunnel stand-in: one thread polls the
//! listening sockets, each TCP connection gets a thread of its own, and stopping closes the
//! listeners, shuts down live connections and joins every thread, promptly.

use std::collections::HashMap;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

use crate::netns;

/// How often (milliseconds) the loop looks at the stop flag.
const STOP_POLL_MS: u8 = 50;

/// Serves one accepted connection, on a thread of its own.
pub type TcpHandler = Arc<dyn Fn(TcpStream, &Tracker) + Send + Sync>;
/// Serves one datagram (payload, sender), on the loop thread.
pub type UdpHandler = Box<dyn FnMut(&UdpSocket, &[u8], SocketAddr) + Send>;

pub enum Listener {
    Tcp(TcpListener, TcpHandler),
    Udp(UdpSocket, UdpHandler),
}

impl Listener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Listener::Tcp(listener, _) => listener.as_fd(),
            Listener::Udp(socket, _) => socket.as_fd(),
        }
    }
}

/// Running listeners; stopped on drop.
pub struct Server {
    stop: Arc<AtomicBool>,
    tracker: Tracker,
    thread: Option<JoinHandle<()>>,
}

impl Server {
    /// Serves `listeners` from a thread inside `netns`, so that sockets the handlers make (the
    /// stand-in's dials) are made there too.
    pub fn start(netns: BorrowedFd<'_>, name: &str, listeners: Vec<Listener>) -> io::Result<Self> {
        for listener in &listeners {
            match listener {
                Listener::Tcp(socket, _) => socket.set_nonblocking(true)?,
                Listener::Udp(socket, _) => socket.set_nonblocking(true)?,
            }
        }
        let stop = Arc::new(AtomicBool::new(false));
        let tracker = Tracker::default();
        let thread = netns::spawn_in(netns.try_clone_to_owned()?, name, {
            let (stop, tracker) = (stop.clone(), tracker.clone());
            move || serve(listeners, &stop, &tracker)
        })?;
        Ok(Self {
            stop,
            tracker,
            thread: Some(thread),
        })
    }

    /// Closes the listeners, shuts down live connections and joins all threads.
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            // A panic there was already printed; re-raising it here could abort (drop).
            let _ = thread.join();
        }
        self.tracker.shut_down_and_join();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

fn serve(mut listeners: Vec<Listener>, stop: &AtomicBool, tracker: &Tracker) {
    let mut buf = vec![0; 64 * 1024];
    while !stop.load(Ordering::Relaxed) {
        let mut fds: Vec<PollFd> = listeners
            .iter()
            .map(|listener| PollFd::new(listener.as_fd(), PollFlags::POLLIN))
            .collect();
        match poll(&mut fds, PollTimeout::from(STOP_POLL_MS)) {
            Ok(0) | Err(nix::Error::EINTR) => continue,
            Ok(_) => {}
            Err(err) => panic!("poll: {err}"),
        }
        let ready: Vec<bool> = fds.iter().map(|fd| fd.any().unwrap_or(false)).collect();
        drop(fds);
        for (listener, _) in listeners.iter_mut().zip(ready).filter(|(_, ready)| *ready) {
            match listener {
                Listener::Tcp(listener, handler) => accept_all(listener, handler, tracker),
                Listener::Udp(socket, handler) => receive_all(socket, handler, &mut buf),
            }
        }
    }
}

fn accept_all(listener: &TcpListener, handler: &TcpHandler, tracker: &Tracker) {
    loop {
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => return,
            Err(err) => {
                eprintln!("accept on {:?}: {err}", listener.local_addr());
                return;
            }
        };
        // Tracked before its thread starts, so a stop racing with this accept still reaches it.
        let guard = stream
            .set_nonblocking(false)
            .and_then(|()| tracker.track(&stream));
        let guard = match guard {
            Ok(guard) => guard,
            Err(err) => {
                eprintln!("cannot serve a connection: {err}");
                continue;
            }
        };
        let (handler, thread_tracker) = (handler.clone(), tracker.clone());
        let spawned = thread::Builder::new().name("conn".into()).spawn(move || {
            let _guard = guard;
            handler(stream, &thread_tracker);
        });
        match spawned {
            Ok(thread) => tracker.adopt(thread),
            Err(err) => eprintln!("cannot start a connection thread: {err}"),
        }
    }
}

fn receive_all(socket: &UdpSocket, handler: &mut UdpHandler, buf: &mut [u8]) {
    loop {
        match socket.recv_from(buf) {
            Ok((len, from)) => handler(socket, &buf[..len], from),
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => return,
            Err(err) => {
                eprintln!("recvfrom on {:?}: {err}", socket.local_addr());
                return;
            }
        }
    }
}

/// Live connections and connection threads of one server.
#[derive(Clone, Default)]
pub struct Tracker {
    state: Arc<Mutex<TrackerState>>,
}

#[derive(Default)]
struct TrackerState {
    next_id: u64,
    /// Clones of the live streams, to shut them down on stop.
    streams: HashMap<u64, TcpStream>,
    threads: Vec<JoinHandle<()>>,
    stopped: bool,
}

impl Tracker {
    /// Registers `stream` until the guard drops; shuts it down at once when already stopped.
    pub fn track(&self, stream: &TcpStream) -> io::Result<Tracked> {
        let clone = stream.try_clone()?;
        let mut state = self.lock();
        if state.stopped {
            let _ = clone.shutdown(Shutdown::Both);
        }
        let id = state.next_id;
        state.next_id += 1;
        state.streams.insert(id, clone);
        Ok(Tracked {
            tracker: self.clone(),
            id,
        })
    }

    fn adopt(&self, thread: JoinHandle<()>) {
        let mut state = self.lock();
        state.threads.retain(|thread| !thread.is_finished());
        state.threads.push(thread);
    }

    fn shut_down_and_join(&self) {
        let threads = {
            let mut state = self.lock();
            state.stopped = true;
            for stream in state.streams.values() {
                let _ = stream.shutdown(Shutdown::Both);
            }
            std::mem::take(&mut state.threads)
        };
        for thread in threads {
            let _ = thread.join();
        }
    }

    fn lock(&self) -> MutexGuard<'_, TrackerState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Unregisters a tracked stream on drop (closing the tracker's clone of it).
pub struct Tracked {
    tracker: Tracker,
    id: u64,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.tracker.lock().streams.remove(&self.id);
    }
}

/// An append-only record that can be waited on.
pub struct Log<T> {
    entries: Mutex<Vec<T>>,
    grew: Condvar,
}

impl<T> Default for Log<T> {
    fn default() -> Self {
        Self {
            entries: Mutex::default(),
            grew: Condvar::new(),
        }
    }
}

impl<T: Clone> Log<T> {
    pub fn push(&self, entry: T) {
        self.lock().push(entry);
        self.grew.notify_all();
    }

    pub fn entries(&self) -> Vec<T> {
        self.lock().clone()
    }

    /// The first entry matching `predicate`, waiting up to `timeout` for one to arrive.
    pub fn wait_for(&self, predicate: impl Fn(&T) -> bool, timeout: Duration) -> Option<T> {
        let deadline = Instant::now() + crate::wait::scaled(timeout);
        let mut entries = self.lock();
        loop {
            if let Some(found) = entries.iter().find(|entry| predicate(entry)) {
                return Some(found.clone());
            }
            let left = deadline.checked_duration_since(Instant::now())?;
            entries = self
                .grew
                .wait_timeout(entries, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Whether the entries came to satisfy `done` (which sees them all, in order) within
    /// `timeout`.
    pub fn wait_until(&self, done: impl Fn(&[T]) -> bool, timeout: Duration) -> bool {
        let deadline = Instant::now() + crate::wait::scaled(timeout);
        let mut entries = self.lock();
        loop {
            if done(&entries) {
                return true;
            }
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return false;
            };
            entries = self
                .grew
                .wait_timeout(entries, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<T>> {
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
