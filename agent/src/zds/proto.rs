//! The ZDS messages (`agent/proto/zds.proto`, package `istio.workload.zds`), declared by hand
//! with prost derives so that building weir needs no `protoc`. The unit tests below hold every
//! field number to the `.proto`.

/// The protocol version ztunnel announces in its [`ZdsHello`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum Version {
    NotUsed = 0,
    V1 = 1,
}

/// ztunnel's first message on a connection.
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct ZdsHello {
    #[prost(enumeration = "Version", tag = "1")]
    pub version: i32,
}

/// Who the pod is: ztunnel builds the proxy's identity from it.
#[derive(Clone, PartialEq, Eq, Hash, prost::Message)]
pub struct WorkloadInfo {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub namespace: String,
    #[prost(string, tag = "3")]
    pub service_account: String,
}

/// Start proxying for a pod; the datagram carries the pod's netns fd.
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct AddWorkload {
    #[prost(string, tag = "1")]
    pub uid: String,
    /// Required by ztunnel (an Add without it is a protocol error there).
    #[prost(message, optional, tag = "2")]
    pub workload_info: Option<WorkloadInfo>,
}

/// Snapshot only: keep the pod's proxy although the agent holds no netns for it.
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct KeepWorkload {
    #[prost(string, tag = "1")]
    pub uid: String,
}

/// Stop proxying for a pod.
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct DelWorkload {
    /// Field 2, as upstream.
    #[prost(string, tag = "2")]
    pub uid: String,
}

/// The snapshot is complete.
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct SnapshotSent {}

/// ztunnel's answer to each request; a non-empty `error` is a failure.
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct Ack {
    #[prost(string, tag = "1")]
    pub error: String,
}

/// Agent → ztunnel.
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct WorkloadRequest {
    #[prost(oneof = "workload_request::Payload", tags = "1, 2, 3, 5")]
    pub payload: Option<workload_request::Payload>,
}

pub mod workload_request {
    #[derive(Clone, PartialEq, Eq, prost::Oneof)]
    pub enum Payload {
        #[prost(message, tag = "1")]
        Add(super::AddWorkload),
        #[prost(message, tag = "2")]
        Del(super::DelWorkload),
        #[prost(message, tag = "3")]
        SnapshotSent(super::SnapshotSent),
        #[prost(message, tag = "5")]
        Keep(super::KeepWorkload),
    }
}

/// ztunnel → agent.
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct WorkloadResponse {
    #[prost(oneof = "workload_response::Payload", tags = "1")]
    pub payload: Option<workload_response::Payload>,
}

pub mod workload_response {
    #[derive(Clone, PartialEq, Eq, prost::Oneof)]
    pub enum Payload {
        #[prost(message, tag = "1")]
        Ack(super::Ack),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use prost::Message;

    use super::workload_request::Payload as Request;
    use super::workload_response::Payload as Response;
    use super::*;

    const PROTO: &str = include_str!("../../proto/zds.proto");

    /// `message`/`enum` name → its `field = number;` entries (oneof members included), read from
    /// the `.proto`. Just enough of a parser for this file's plain syntax.
    fn proto_fields() -> BTreeMap<String, BTreeMap<String, u64>> {
        let mut all = BTreeMap::new();
        let mut current: Option<String> = None;
        let mut depth = 0;
        for line in PROTO.lines() {
            let line = line.split("//").next().unwrap().trim();
            if line.is_empty() {
                continue;
            }
            if depth == 0 {
                if let Some(rest) = line
                    .strip_prefix("message ")
                    .or_else(|| line.strip_prefix("enum "))
                {
                    let name = rest.trim_end_matches('{').trim().to_owned();
                    all.insert(name.clone(), BTreeMap::new());
                    current = Some(name);
                }
            } else if let Some((left, right)) = line.split_once('=') {
                if !line.starts_with("reserved") {
                    let field = left.split_whitespace().last().unwrap().to_owned();
                    let number = right.trim().trim_end_matches(';').trim().parse().unwrap();
                    let message = current.as_ref().unwrap();
                    all.get_mut(message).unwrap().insert(field, number);
                }
            }
            depth += line.matches('{').count();
            depth -= line.matches('}').count();
        }
        all
    }

    /// The field number and wire type of the first (only) field in `bytes`.
    fn only_key(bytes: &[u8]) -> (u64, u8) {
        let mut buf = bytes;
        let key = prost::encoding::decode_varint(&mut buf).unwrap();
        (key >> 3, (key & 7) as u8)
    }

    fn with<T>(value: T, set: impl FnOnce(&mut T)) -> T {
        let mut value = value;
        set(&mut value);
        value
    }

    /// For every message: each field's encoding when only that field is set.
    fn rust_fields() -> BTreeMap<&'static str, Vec<(&'static str, Vec<u8>)>> {
        let info = || WorkloadInfo::default();
        let request = |payload| {
            WorkloadRequest {
                payload: Some(payload),
            }
            .encode_to_vec()
        };
        BTreeMap::from([
            (
                "ZdsHello",
                vec![(
                    "version",
                    ZdsHello {
                        version: Version::V1 as i32,
                    }
                    .encode_to_vec(),
                )],
            ),
            (
                "WorkloadInfo",
                vec![
                    (
                        "name",
                        with(info(), |i| i.name = "n".into()).encode_to_vec(),
                    ),
                    (
                        "namespace",
                        with(info(), |i| i.namespace = "n".into()).encode_to_vec(),
                    ),
                    (
                        "service_account",
                        with(info(), |i| i.service_account = "s".into()).encode_to_vec(),
                    ),
                ],
            ),
            (
                "AddWorkload",
                vec![
                    (
                        "uid",
                        AddWorkload {
                            uid: "u".into(),
                            workload_info: None,
                        }
                        .encode_to_vec(),
                    ),
                    (
                        "workload_info",
                        AddWorkload {
                            uid: String::new(),
                            workload_info: Some(info()),
                        }
                        .encode_to_vec(),
                    ),
                ],
            ),
            (
                "KeepWorkload",
                vec![("uid", KeepWorkload { uid: "u".into() }.encode_to_vec())],
            ),
            (
                "DelWorkload",
                vec![("uid", DelWorkload { uid: "u".into() }.encode_to_vec())],
            ),
            ("SnapshotSent", vec![]),
            (
                "Ack",
                vec![("error", Ack { error: "e".into() }.encode_to_vec())],
            ),
            (
                "WorkloadRequest",
                vec![
                    ("add", request(Request::Add(AddWorkload::default()))),
                    ("keep", request(Request::Keep(KeepWorkload::default()))),
                    ("del", request(Request::Del(DelWorkload::default()))),
                    (
                        "snapshot_sent",
                        request(Request::SnapshotSent(SnapshotSent {})),
                    ),
                ],
            ),
            (
                "WorkloadResponse",
                vec![(
                    "ack",
                    WorkloadResponse {
                        payload: Some(Response::Ack(Ack::default())),
                    }
                    .encode_to_vec(),
                )],
            ),
        ])
    }

    #[test]
    fn field_numbers_match_the_proto() {
        let proto = proto_fields();
        let rust = rust_fields();
        let mut messages: Vec<_> = proto.keys().map(String::as_str).collect();
        messages.retain(|name| *name != "Version");
        assert_eq!(messages, rust.keys().copied().collect::<Vec<_>>());
        for (message, fields) in rust {
            let expected = &proto[message];
            let names: Vec<_> = expected.keys().map(String::as_str).collect();
            let mut ours: Vec<_> = fields.iter().map(|(name, _)| *name).collect();
            ours.sort();
            assert_eq!(ours, names, "fields of {message}");
            for (field, bytes) in fields {
                let (number, wire_type) = only_key(&bytes);
                assert_eq!(number, expected[field], "{message}.{field}: {bytes:02x?}");
                // Strings and messages are length-delimited (2); the enum is a varint (0).
                let scalar = message == "ZdsHello";
                assert_eq!(wire_type, if scalar { 0 } else { 2 }, "{message}.{field}");
            }
        }
        let version = &proto["Version"];
        assert_eq!(version["NOT_USED"], Version::NotUsed as u64);
        assert_eq!(version["V1"], Version::V1 as u64);
    }

    #[test]
    fn wire_bytes() {
        let add = WorkloadRequest {
            payload: Some(Request::Add(AddWorkload {
                uid: "u1".into(),
                workload_info: Some(WorkloadInfo {
                    name: "p".into(),
                    namespace: "ns".into(),
                    service_account: "sa".into(),
                }),
            })),
        };
        #[rustfmt::skip]
        let expected = [
            0x0a, 17, // WorkloadRequest.add
                0x0a, 2, b'u', b'1', // AddWorkload.uid
                0x12, 11, // AddWorkload.workload_info
                    0x0a, 1, b'p', 0x12, 2, b'n', b's', 0x1a, 2, b's', b'a',
        ];
        assert_eq!(add.encode_to_vec(), expected);

        let del = WorkloadRequest {
            payload: Some(Request::Del(DelWorkload { uid: "u".into() })),
        };
        assert_eq!(del.encode_to_vec(), [0x12, 3, 0x12, 1, b'u']);
        let keep = WorkloadRequest {
            payload: Some(Request::Keep(KeepWorkload { uid: "u".into() })),
        };
        assert_eq!(keep.encode_to_vec(), [0x2a, 3, 0x0a, 1, b'u']);
        let sent = WorkloadRequest {
            payload: Some(Request::SnapshotSent(SnapshotSent {})),
        };
        assert_eq!(sent.encode_to_vec(), [0x1a, 0]);
        let hello = ZdsHello {
            version: Version::V1 as i32,
        };
        assert_eq!(hello.encode_to_vec(), [0x08, 1]);
        let ack = WorkloadResponse::decode(&[0x0a, 0][..]).unwrap();
        assert_eq!(ack.payload, Some(Response::Ack(Ack::default())));
        let nack = WorkloadResponse::decode(&[0x0a, 3, 0x0a, 1, b'x'][..]).unwrap();
        assert_eq!(nack.payload, Some(Response::Ack(Ack { error: "x".into() })));
    }
}
