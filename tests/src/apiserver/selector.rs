//! The `labelSelector` and `fieldSelector` of a LIST or WATCH, parsed and matched against objects.

use serde_json::Value;

/// Both selectors of a request; an object is selected when it meets every requirement.
#[derive(Debug, Default)]
pub(super) struct Selectors {
    labels: Vec<Requirement>,
    fields: Vec<Requirement>,
}

#[derive(Debug)]
struct Requirement {
    key: String,
    test: Test,
}

#[derive(Debug)]
enum Test {
    Exists,
    Absent,
    In(Vec<String>),
    /// Also met when the key is absent, as `k!=v` and `k notin (..)` are in Kubernetes.
    NotIn(Vec<String>),
}

impl Selectors {
    /// Parses the label forms `k=v`, `k==v`, `k!=v`, `k`, `!k`, `k in (a,b)`, `k notin (a,b)` and
    /// the field forms `path=v`, `path==v`, `path!=v`, where a path such as `spec.nodeName` or
    /// `metadata.name` reaches into the object's JSON. Unlike the API server, any path is accepted.
    pub(super) fn parse(labels: Option<&str>, fields: Option<&str>) -> Result<Self, String> {
        Ok(Selectors {
            labels: terms(labels)
                .into_iter()
                .map(label_requirement)
                .collect::<Result<_, _>>()?,
            fields: terms(fields)
                .into_iter()
                .map(field_requirement)
                .collect::<Result<_, _>>()?,
        })
    }

    pub(super) fn matches(&self, object: &Value) -> bool {
        let labels = &object["metadata"]["labels"];
        self.labels
            .iter()
            .all(|r| r.test.passes(labels[&r.key].as_str()))
            && self
                .fields
                .iter()
                .all(|r| r.test.passes(Some(&field_value(object, &r.key))))
    }
}

impl Test {
    fn passes(&self, value: Option<&str>) -> bool {
        let among = |values: &Vec<String>| value.is_some_and(|v| values.iter().any(|x| x == v));
        match self {
            Test::Exists => value.is_some(),
            Test::Absent => value.is_none(),
            Test::In(values) => among(values),
            Test::NotIn(values) => !among(values),
        }
    }
}

/// Splits at the commas that separate requirements, not those inside `in (a,b)`.
fn terms(text: Option<&str>) -> Vec<&str> {
    let text = text.unwrap_or("").trim();
    if text.is_empty() {
        return Vec::new();
    }
    let (mut terms, mut start, mut depth) = (Vec::new(), 0, 0);
    for (at, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                terms.push(&text[start..at]);
                start = at + 1;
            }
            _ => {}
        }
    }
    terms.push(&text[start..]);
    terms.into_iter().map(str::trim).collect()
}

fn label_requirement(term: &str) -> Result<Requirement, String> {
    let requirement = |key: &str, test| Requirement {
        key: key.trim().to_owned(),
        test,
    };
    let one = |value: &str| vec![value.trim().to_owned()];
    if let Some(key) = term.strip_prefix('!') {
        return Ok(requirement(key, Test::Absent));
    }
    if let Some((key, value)) = term.split_once("!=") {
        return Ok(requirement(key, Test::NotIn(one(value))));
    }
    if let Some((key, value)) = term.split_once("==").or_else(|| term.split_once('=')) {
        return Ok(requirement(key, Test::In(one(value))));
    }
    if let Some((key, values)) = term.split_once(" notin ") {
        return Ok(requirement(key, Test::NotIn(value_set(values)?)));
    }
    if let Some((key, values)) = term.split_once(" in ") {
        return Ok(requirement(key, Test::In(value_set(values)?)));
    }
    if !term.is_empty() && !term.contains([' ', '(', ')']) {
        return Ok(requirement(term, Test::Exists));
    }
    Err(format!("unable to parse requirement: {term:?}"))
}

fn value_set(text: &str) -> Result<Vec<String>, String> {
    let inner = text
        .trim()
        .strip_prefix('(')
        .and_then(|t| t.strip_suffix(')'));
    let inner = inner.ok_or_else(|| format!("expected a parenthesised set, got {text:?}"))?;
    Ok(inner.split(',').map(|v| v.trim().to_owned()).collect())
}

fn field_requirement(term: &str) -> Result<Requirement, String> {
    let requirement = |key: &str, test| Requirement {
        key: key.trim().to_owned(),
        test,
    };
    let one = |value: &str| vec![value.trim().to_owned()];
    if let Some((key, value)) = term.split_once("!=") {
        return Ok(requirement(key, Test::NotIn(one(value))));
    }
    if let Some((key, value)) = term.split_once("==").or_else(|| term.split_once('=')) {
        return Ok(requirement(key, Test::In(one(value))));
    }
    Err(format!("invalid field selector: {term:?}"))
}

/// A field as the API server's field sets have it: absent fields are the empty string, which is
/// what `spec.nodeName=` (pods not yet scheduled) relies on.
fn field_value(object: &Value, path: &str) -> String {
    match path.split('.').fold(object, |value, key| &value[key]) {
        Value::String(text) => text.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}
