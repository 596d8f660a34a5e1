//! CNI error results: what the plugin prints on stdout when it fails.
use std::fmt;

/// Error codes defined by the CNI specification (codes 1-99 are reserved for it).
pub mod code {
    pub const INCOMPATIBLE_VERSION: u32 = 1;
    pub const INVALID_ENVIRONMENT: u32 = 4;
    pub const IO_FAILURE: u32 = 5;
    pub const DECODE_FAILURE: u32 = 6;
    pub const INVALID_CONFIG: u32 = 7;
    /// The only code that asks the runtime to retry: for conditions that clear up.
    pub const TRY_AGAIN_LATER: u32 = 11;
    /// A failure the spec has no code for, which a retry does not cure: libcni's `ErrInternal`,
    /// what plugins built on it report for a plain error (codes from 100 are the plugins' own).
    pub const PLUGIN_SPECIFIC: u32 = 999;
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CniError {
    pub code: u32,
    pub msg: String,
    pub details: String,
}

impl CniError {
    pub fn new(code: u32, msg: impl Into<String>) -> Self {
        Self {
            code,
            msg: msg.into(),
            details: String::new(),
        }
    }

    pub fn with_details(mut self, details: impl Into<String>) -> Self {
        self.details = details.into();
        self
    }

    /// The error result as the spec shapes it, in the version the runtime asked for.
    pub fn to_json(&self, cni_version: &str) -> String {
        serde_json::json!({
            "cniVersion": cni_version,
            "code": self.code,
            "msg": self.msg,
            "details": self.details,
        })
        .to_string()
    }
}

impl fmt::Display for CniError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "error {}: {}", self.code, self.msg)?;
        if !self.details.is_empty() {
            write!(f, " ({})", self.details)?;
        }
        Ok(())
    }
}

/// Maps a config decoding failure to the spec's codes: broken JSON cannot be decoded (6), while
/// well-formed JSON with a wrong field is an invalid network config (7).
pub fn from_decode(what: &str, err: serde_json::Error) -> CniError {
    let code = match err.classify() {
        serde_json::error::Category::Data => code::INVALID_CONFIG,
        _ => code::DECODE_FAILURE,
    };
    CniError::new(code, format!("cannot decode {what}")).with_details(err.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_has_the_spec_fields() {
        let err = CniError::new(code::TRY_AGAIN_LATER, "later").with_details("why");
        let json: serde_json::Value = serde_json::from_str(&err.to_json("1.0.0")).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"cniVersion": "1.0.0", "code": 11, "msg": "later", "details": "why"})
        );
    }

    #[test]
    fn syntax_errors_and_type_errors_get_different_codes() {
        let syntax = serde_json::from_str::<serde_json::Value>("{").unwrap_err();
        assert_eq!(from_decode("x", syntax).code, code::DECODE_FAILURE);
        let data = serde_json::from_str::<u32>("\"a\"").unwrap_err();
        assert_eq!(from_decode("x", data).code, code::INVALID_CONFIG);
    }
}
