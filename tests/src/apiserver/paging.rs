//! Lists answered a page at a time, as `limit` and `continue` ask. Every page of one list reads
//! from the list as it was when its first page was made, as the API server's continued lists do.

use std::collections::HashMap;
use std::time::Duration;

use serde_json::Value;

use super::store::ApiError;

#[derive(Default)]
pub(super) struct Paging {
    /// At most this many items a page, whatever `limit` asks: an API server may return fewer.
    max_items: Option<usize>,
    /// How long the next page of a continued list takes to come.
    continue_delay: Duration,
    /// The items not yet handed out of each list continued, and its version, by token.
    unread: HashMap<String, (Vec<Value>, u64)>,
    tokens_issued: u64,
}

/// One page of a list.
pub(super) struct Page {
    pub items: Vec<Value>,
    pub version: u64,
    /// Where the next page starts, if there is one.
    pub continue_token: Option<String>,
    pub remaining: usize,
}

impl Paging {
    pub(super) fn limit_pages(&mut self, max_items: usize, continue_delay: Duration) {
        self.max_items = Some(max_items.max(1));
        self.continue_delay = continue_delay;
    }

    pub(super) fn continue_delay(&self) -> Duration {
        self.continue_delay
    }

    /// The page that `token` continues from.
    pub(super) fn next(&mut self, token: &str, limit: Option<usize>) -> Result<Page, ApiError> {
        let (items, version) = self.unread.remove(token).ok_or_else(|| {
            let message = "the provided continue parameter is too old to display a consistent \
                           list result; start a new list without it";
            ApiError::new(410, "Expired", message)
        })?;
        Ok(self.page(items, version, limit))
    }

    /// The first page of `items`, a list made at `version`; the rest wait for a `continue`.
    pub(super) fn page(
        &mut self,
        mut items: Vec<Value>,
        version: u64,
        limit: Option<usize>,
    ) -> Page {
        let size = match (limit.filter(|&limit| limit > 0), self.max_items) {
            (Some(limit), Some(max)) => limit.min(max),
            (Some(size), None) | (None, Some(size)) => size,
            (None, None) => items.len(),
        };
        if items.len() <= size {
            return Page {
                items,
                version,
                continue_token: None,
                remaining: 0,
            };
        }
        let rest = items.split_off(size);
        self.tokens_issued += 1;
        let token = format!("continue-{}", self.tokens_issued);
        let remaining = rest.len();
        self.unread.insert(token.clone(), (rest, version));
        Page {
            items,
            version,
            continue_token: Some(token),
            remaining,
        }
    }
}
