//! A WATCH response body: newline-delimited JSON events, one chunk each, until the watch times
//! out, the store drops it, or the client goes away.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Duration;

use axum::body::Body;
use serde_json::json;
use tokio::sync::mpsc;
use tokio::time::{self, Instant, Interval};

use super::store::{event_line, Resource, Watch};
use super::Shared;

/// How often a watch that allows bookmarks gets one. The API server's is about a minute; shorter
/// here so that a test sees them, long enough not to crowd the events.
const BOOKMARK_INTERVAL: Duration = Duration::from_secs(5);

pub(super) struct WatchStream {
    store: Shared,
    resource: &'static Resource,
    pending: VecDeque<String>,
    /// `None` once the stream is to end when `pending` is sent.
    live: Option<mpsc::UnboundedReceiver<String>>,
    bookmarks: Option<Interval>,
    deadline: Option<Instant>,
}

impl WatchStream {
    pub(super) fn new(
        store: Shared,
        resource: &'static Resource,
        watch: Watch,
        allow_bookmarks: bool,
        timeout: Option<Duration>,
    ) -> Self {
        let (pending, live) = match watch {
            Watch::Open { backlog, live } => (backlog.into(), Some(live)),
            Watch::Expired(error) => (VecDeque::from([event_line("ERROR", &error.status())]), None),
        };
        let bookmarks = allow_bookmarks
            .then(|| time::interval_at(Instant::now() + BOOKMARK_INTERVAL, BOOKMARK_INTERVAL));
        let deadline = timeout.map(|timeout| Instant::now() + timeout);
        WatchStream {
            store,
            resource,
            pending,
            live,
            bookmarks,
            deadline,
        }
    }

    pub(super) fn into_body(self) -> Body {
        Body::from_stream(futures::stream::unfold(self, |mut watch| async move {
            let line = watch.next_line().await?;
            Some((Ok::<_, Infallible>(line), watch))
        }))
    }

    async fn next_line(&mut self) -> Option<String> {
        loop {
            if let Some(line) = self.pending.pop_front() {
                return Some(line);
            }
            let live = self.live.as_mut()?;
            let deadline = self.deadline;
            let bookmarks = self.bookmarks.as_mut();
            let bookmarks_allowed = bookmarks.is_some();
            tokio::select! {
                line = live.recv() => match line {
                    Some(line) => return Some(line),
                    None => self.live = None,
                },
                _ = async { time::sleep_until(deadline?).await; Some(()) }, if deadline.is_some() => {
                    // The API server marks the end of a timed-out watch with a bookmark, so the
                    // client resumes from the newest version.
                    if self.bookmarks.is_some() {
                        self.queue_bookmark();
                    }
                    self.live = None;
                }
                _ = async { bookmarks?.tick().await; Some(()) }, if bookmarks_allowed => {
                    self.queue_bookmark()
                }
            }
        }
    }

    /// Queues a bookmark behind every change already sent to this watch, so that its version
    /// never runs ahead of an event still to come.
    fn queue_bookmark(&mut self) {
        let store = self.store.lock();
        if let Some(live) = self.live.as_mut() {
            while let Ok(line) = live.try_recv() {
                self.pending.push_back(line);
            }
        }
        let bookmark = json!({
            "kind": self.resource.kind,
            "apiVersion": self.resource.api_version,
            "metadata": { "resourceVersion": store.resource_version().to_string() },
        });
        self.pending.push_back(event_line("BOOKMARK", &bookmark));
    }
}
