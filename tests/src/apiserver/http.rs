//! The wire side: which path is which object or collection, and what each method does there.

use std::collections::HashMap;
use std::time::Duration;

use axum::body::{to_bytes, Body};
use axum::extract::{Request, State};
use axum::http::header::CONTENT_TYPE;
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use serde_json::{json, Value};

use super::selector::Selectors;
use super::store::{ApiError, PatchType, Resource, Scope};
use super::watch::WatchStream;
use super::{ApiRequest, Shared};

pub(super) fn router(store: Shared) -> Router {
    Router::new().fallback(serve).with_state(store)
}

/// Where a request goes: `/api/v1/...` or `/apis/GROUP/VERSION/...`, then
/// `[namespaces/NS/]PLURAL[/NAME[/status]]`.
struct Route {
    resource: &'static Resource,
    namespace: Option<String>,
    name: Option<String>,
    status_subresource: bool,
}

impl Route {
    fn parse(path: &str) -> Option<Route> {
        let (api_version, rest) = match path.strip_prefix("/api/v1/") {
            Some(rest) => ("v1".to_owned(), rest),
            None => {
                let mut parts = path.strip_prefix("/apis/")?.splitn(3, '/');
                let (group, version) = (parts.next()?, parts.next()?);
                (format!("{group}/{version}"), parts.next()?)
            }
        };
        let segments: Vec<&str> = rest.split('/').collect();
        let (namespace, segments) = match segments.as_slice() {
            ["namespaces", namespace, rest @ ..] if !rest.is_empty() => (Some(*namespace), rest),
            all => (None, all),
        };
        let (plural, name, subresource) = match segments {
            [plural] => (*plural, None, None),
            [plural, name] => (*plural, Some(*name), None),
            [plural, name, subresource] => (*plural, Some(*name), Some(*subresource)),
            _ => return None,
        };
        let resource = Resource::at(&api_version, plural)?;
        let scoped_right = if resource.namespaced {
            name.is_none() || namespace.is_some()
        } else {
            namespace.is_none()
        };
        if !scoped_right || subresource.is_some_and(|s| s != "status") {
            return None;
        }
        Some(Route {
            resource,
            namespace: namespace.map(str::to_owned),
            name: name.map(str::to_owned),
            status_subresource: subresource.is_some(),
        })
    }

    fn namespace(&self) -> &str {
        self.namespace.as_deref().unwrap_or("")
    }
}

async fn serve(State(store): State<Shared>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let content_type = parts
        .headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok());
    let content_type = content_type.map(|t| t.split(';').next().unwrap_or(t).trim().to_owned());
    let query = parts.uri.query().unwrap_or("").to_owned();
    let params: HashMap<String, String> = form_urlencoded::parse(query.as_bytes())
        .into_owned()
        .collect();
    let route = Route::parse(parts.uri.path());
    let endpoint = Endpoint::of(&parts.method, parts.uri.path());
    let verb = match endpoint {
        Some(endpoint) => endpoint.verb().to_owned(),
        None => verb(&parts.method, route.as_ref(), &params),
    };
    let body = to_bytes(body, usize::MAX).await;
    store.lock().record(ApiRequest {
        verb: verb.clone(),
        method: parts.method.to_string(),
        path: parts.uri.path().to_owned(),
        query,
        content_type: content_type.clone(),
        body: body
            .as_ref()
            .ok()
            .and_then(|body| serde_json::from_slice(body).ok()),
    });

    let not_found = || {
        let message = "the server could not find the requested resource";
        respond(Err(ApiError::new(404, "NotFound", message)))
    };
    match endpoint {
        Some(Endpoint::Version) => return respond(Ok((StatusCode::OK, version()))),
        Some(Endpoint::AccessReview) if store.lock().access_reviews_unserved => return not_found(),
        Some(Endpoint::AccessReview) => {
            let body = body.map_err(|error| ApiError::new(400, "BadRequest", error.to_string()));
            return respond(body.and_then(|body| review_access(&store, &body)));
        }
        None => {}
    }
    let Some(route) = route else {
        return not_found();
    };
    let body = match body {
        Ok(body) => body,
        Err(error) => return respond(Err(ApiError::new(400, "BadRequest", error.to_string()))),
    };
    let json_body = || -> Result<Value, ApiError> {
        if body.is_empty() {
            return Ok(Value::Null);
        }
        serde_json::from_slice(&body).map_err(|e| ApiError::new(400, "BadRequest", e.to_string()))
    };
    let ok = |object| (StatusCode::OK, object);

    let answer = match (verb.as_str(), route.name.as_deref()) {
        ("watch", None) => return watch(store, route, &params),
        ("list", None) => {
            store.lists_answered(route.resource).await;
            list(&store, route, &params).await
        }
        ("get", Some(name)) => store
            .lock()
            .get(route.resource, route.namespace(), name)
            .map(ok),
        ("create", None) => json_body().and_then(|object| {
            let created = store
                .lock()
                .create(route.resource, route.namespace(), object)?;
            Ok((StatusCode::CREATED, created))
        }),
        ("patch", Some(name)) => {
            let Some(patch_type) = PatchType::of(content_type.as_deref().unwrap_or("")) else {
                let message = format!(
                    "the stand-in applies merge and strategic merge patches only, not \
                     {content_type:?}"
                );
                return respond(Err(ApiError::new(415, "UnsupportedMediaType", message)));
            };
            json_body()
                .and_then(|patch| {
                    let mut store = store.lock();
                    store.patch(
                        route.resource,
                        route.namespace(),
                        name,
                        route.status_subresource,
                        patch_type,
                        &patch,
                    )
                })
                .map(ok)
        }
        ("delete", Some(name)) => json_body()
            .and_then(|options| {
                store.lock().delete(
                    route.resource,
                    route.namespace(),
                    name,
                    &options["preconditions"],
                )
            })
            .map(ok),
        _ => Err(ApiError::new(
            405,
            "MethodNotAllowed",
            format!("{} is not supported here", parts.method),
        )),
    };
    respond(answer)
}

/// The paths that name no stored object.
#[derive(Clone, Copy)]
enum Endpoint {
    /// `GET /version`, as kube-rs's `Client::apiserver_version` asks.
    Version,
    /// `POST` of a SelfSubjectAccessReview: answered, never stored.
    AccessReview,
}

impl Endpoint {
    fn of(method: &Method, path: &str) -> Option<Endpoint> {
        match (method, path) {
            (&Method::GET, "/version") => Some(Endpoint::Version),
            (&Method::POST, "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews") => {
                Some(Endpoint::AccessReview)
            }
            _ => None,
        }
    }

    fn verb(self) -> &'static str {
        match self {
            Endpoint::Version => "get",
            Endpoint::AccessReview => "create",
        }
    }
}

/// What a Kubernetes 1.34 API server answers at `/version`.
fn version() -> Value {
    json!({
        "major": "1",
        "minor": "34",
        "gitVersion": "v1.34.0",
        "gitCommit": "f28b4c9efbca5c5c0af716d9f2d5702667ee8a45",
        "gitTreeState": "clean",
        "buildDate": "2025-08-27T10:15:35Z",
        "goVersion": "go1.24.6",
        "compiler": "gc",
        "platform": "linux/amd64",
    })
}

/// The review sent back with its `status`: allowed, unless [`super::ApiServer::deny`] named its
/// verb, group and resource (`resource/subresource` for a subresource).
fn review_access(store: &Shared, body: &[u8]) -> Result<(StatusCode, Value), ApiError> {
    let mut review: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::new(400, "BadRequest", e.to_string()))?;
    let attributes = &review["spec"]["resourceAttributes"];
    let field = |name: &str| attributes[name].as_str().unwrap_or_default().to_owned();
    let resource = match field("subresource") {
        subresource if subresource.is_empty() => field("resource"),
        subresource => format!("{}/{subresource}", field("resource")),
    };
    let asked = (field("verb"), field("group"), resource);
    let allowed = !store.lock().denied.contains(&asked);
    review["status"] = if allowed {
        json!({ "allowed": true, "reason": "allowed by the API stand-in" })
    } else {
        json!({ "allowed": false, "reason": "denied by the API stand-in" })
    };
    Ok((StatusCode::CREATED, review))
}

/// The request's verb as Kubernetes names it (RBAC, audit logs); the stand-in serves the six
/// named here.
fn verb(method: &Method, route: Option<&Route>, params: &HashMap<String, String>) -> String {
    let collection = route.is_some_and(|route| route.name.is_none());
    let watching = matches!(params.get("watch").map(String::as_str), Some("true" | "1"));
    let verb = match *method {
        Method::GET if collection && watching => "watch",
        Method::GET if collection => "list",
        Method::GET => "get",
        Method::POST if collection => "create",
        Method::PATCH if !collection => "patch",
        Method::DELETE if !collection => "delete",
        Method::DELETE => "deletecollection",
        Method::PUT => "update",
        _ => return method.as_str().to_lowercase(),
    };
    verb.to_owned()
}

fn scope(route: Route, params: &HashMap<String, String>) -> Result<Scope, ApiError> {
    let selectors = Selectors::parse(
        params.get("labelSelector").map(String::as_str),
        params.get("fieldSelector").map(String::as_str),
    )
    .map_err(|message| ApiError::new(400, "BadRequest", message))?;
    Ok(Scope {
        resource: route.resource,
        namespace: route.namespace,
        selectors,
    })
}

/// A page of the list, as `limit` and `continue` ask.
async fn list(
    store: &Shared,
    route: Route,
    params: &HashMap<String, String>,
) -> Result<(StatusCode, Value), ApiError> {
    let resource = route.resource;
    let limit = params.get("limit").and_then(|limit| limit.parse().ok());
    let page = match params.get("continue").filter(|token| !token.is_empty()) {
        Some(token) => {
            let delay = store.lock().paging.continue_delay();
            tokio::time::sleep(delay).await;
            store.lock().paging.next(token, limit)?
        }
        None => {
            let mut store = store.lock();
            let (items, version) = store.list(&scope(route, params)?);
            store.paging.page(items, version, limit)
        }
    };
    let mut metadata = json!({ "resourceVersion": page.version.to_string() });
    if let Some(token) = page.continue_token {
        metadata["continue"] = token.into();
        metadata["remainingItemCount"] = page.remaining.into();
    }
    let list = json!({
        "kind": format!("{}List", resource.kind),
        "apiVersion": resource.api_version,
        "metadata": metadata,
        "items": page.items,
    });
    Ok((StatusCode::OK, list))
}

fn watch(store: Shared, route: Route, params: &HashMap<String, String>) -> Response {
    let resource = route.resource;
    let from = match params.get("resourceVersion").map(String::as_str) {
        None | Some("" | "0") => None,
        Some(version) => match version.parse() {
            Ok(version) => Some(version),
            Err(_) => {
                let message = format!("invalid resourceVersion {version:?}");
                return respond(Err(ApiError::new(400, "BadRequest", message)));
            }
        },
    };
    let scope = match scope(route, params) {
        Ok(scope) => scope,
        Err(error) => return respond(Err(error)),
    };
    let bookmarks = params
        .get("allowWatchBookmarks")
        .is_some_and(|v| v == "true" || v == "1");
    let timeout = params
        .get("timeoutSeconds")
        .and_then(|s| s.parse().ok())
        .map(Duration::from_secs);
    let opened = store.lock().watch(scope, from);
    let body = WatchStream::new(store, resource, opened, bookmarks, timeout).into_body();
    ([(CONTENT_TYPE, "application/json")], body).into_response()
}

fn respond(answer: Result<(StatusCode, Value), ApiError>) -> Response {
    let (status, body) = match answer {
        Ok(answer) => answer,
        Err(error) => {
            let status =
                StatusCode::from_u16(error.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            (status, error.status())
        }
    };
    (
        status,
        [(CONTENT_TYPE, "application/json")],
        Body::from(body.to_string()),
    )
        .into_response()
}
