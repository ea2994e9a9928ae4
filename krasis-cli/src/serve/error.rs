//! OpenAI's error body (`{"error": {"message", "type", "param", "code"}}`) with the HTTP status
//! that goes with it. Every failure a client can cause ends here, never in a panic.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

/// A request that failed, as the client sees it.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`, `server_error`, …
    pub kind: &'static str,
    /// The request field at fault, where known.
    pub param: Option<&'static str>,
    /// OpenAI's machine-readable `code` (`context_length_exceeded`, `invalid_api_key`, …).
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400: the request is malformed or asks for something invalid.
    pub fn invalid(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }

    /// 400 naming the field at fault.
    pub fn invalid_param(param: &'static str, message: impl Into<String>) -> Self {
        ApiError { param: Some(param), ..Self::invalid(message) }
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn with_status(mut self, status: StatusCode) -> Self {
        self.status = status;
        self
    }

    /// 401: a missing or wrong API key.
    pub fn unauthorized(message: impl Into<String>, code: Option<&'static str>) -> Self {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code,
        }
    }

    /// 404: no such route or model.
    pub fn not_found(message: impl Into<String>) -> Self {
        ApiError { status: StatusCode::NOT_FOUND, code: Some("not_found"), ..Self::invalid(message) }
    }

    /// 429: every slot and queue place is taken.
    pub fn busy(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: message.into(),
            kind: "rate_limit_error",
            param: None,
            code: Some("server_busy"),
        }
    }

    /// 503: the server is shutting down.
    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    /// 500: the engine failed.
    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    /// The JSON body (also sent as an SSE event when a stream fails after it started).
    pub fn body(&self) -> serde_json::Value {
        json!({
            "error": {
                // A library message names options (`GpuOptions::vram_budget`); the server's
                // operator sets them as flags.
                "message": crate::flags::with_flags(&self.message),
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}
