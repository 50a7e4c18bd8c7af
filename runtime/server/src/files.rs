//! Streamed file transfer: `PUT /v1/sandboxes/{id}/files?path=` takes a file's content as the
//! raw request body, `GET` of the same route answers it as the raw response body. Neither side
//! holds the whole file: the body goes through a small channel, a piece at a time, between the
//! connection and the backend's blocking call ([`SandboxApi::upload`],
//! [`SandboxApi::download`]), which writes or reads the file as the sandbox's user. Memory per
//! transfer is bounded by [`PIECES`] pieces of at most the connection's read size (or
//! [`PIECE`] bytes on the way out), whatever the file's size.
//!
//! An upload is bounded by `max_upload_bytes` (a larger `Content-Length` is refused before a
//! byte is read), not by `max_body_bytes`, which bounds the JSON bodies the server holds whole.

use std::io;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt as _;
use taskbox_core::api::{ApiError, ByteSink, DownloadRequest, UploadRequest, WriteResult};
use tokio::sync::mpsc;

use crate::body::BodyTimeout;
use crate::error::HttpError;
use crate::extract::{ApiQuery, Owned};
use crate::state::AppState;

/// Pieces in flight between the connection and the backend.
const PIECES: usize = 8;
/// The size of a piece of a download.
const PIECE: usize = 256 * 1024;

/// Why the body of an upload stopped, as the connection saw it (the backend only sees an I/O
/// error of its reader, and says the content stopped arriving).
enum Cut {
    Timeout(BodyTimeout),
    TooLarge(u64),
    Broken(String),
}

/// The request body as a blocking reader for the backend's thread.
struct ChannelReader {
    rx: mpsc::Receiver<io::Result<Bytes>>,
    current: Bytes,
}

impl io::Read for ChannelReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.current.is_empty() {
            match self.rx.blocking_recv() {
                Some(Ok(piece)) => self.current = piece,
                Some(Err(e)) => return Err(e),
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.current.len());
        buf[..n].copy_from_slice(&self.current.split_to(n));
        Ok(n)
    }
}

/// `PUT /v1/sandboxes/{id}/files?path=PATH[&create_parents=true][&mode=N]`: the body is the
/// file's content.
pub async fn upload(
    State(state): State<AppState>,
    o: Owned,
    ApiQuery(req): ApiQuery<UploadRequest>,
    request: axum::extract::Request,
) -> Result<axum::Json<WriteResult>, HttpError> {
    let max = state.limits().max_upload_bytes;
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if let Some(n) = declared.filter(|n| *n > max) {
        return Err(HttpError::upload_too_large("file", n, max));
    }
    let (tx, rx) = mpsc::channel::<io::Result<Bytes>>(PIECES);
    let backend = state.backend().clone();
    let id = o.id.clone();
    let call = tokio::task::spawn_blocking(move || {
        let mut body = ChannelReader {
            rx,
            current: Bytes::new(),
        };
        backend.upload(&id, req, &mut body)
    });
    let mut body = request.into_body().into_data_stream();
    let mut seen = 0u64;
    let mut cut = None;
    while let Some(piece) = body.next().await {
        let piece = match piece {
            Ok(p) => p,
            Err(e) => {
                let why = match BodyTimeout::find(&e) {
                    Some(t) => Cut::Timeout(t),
                    None => Cut::Broken(e.to_string()),
                };
                let _ = tx
                    .send(Err(io::Error::other("the request body broke off")))
                    .await;
                cut = Some(why);
                break;
            }
        };
        seen += piece.len() as u64;
        if seen > max {
            let _ = tx
                .send(Err(io::Error::other("the upload is over max_upload_bytes")))
                .await;
            cut = Some(Cut::TooLarge(seen));
            break;
        }
        // The backend stopped reading (it refused the file): its answer says why.
        if tx.send(Ok(piece)).await.is_err() {
            break;
        }
    }
    drop(tx);
    let answer = call
        .await
        .map_err(|e| HttpError::Api(ApiError::internal(format!("backend call failed: {e}"))))?;
    match (answer, cut) {
        (Ok(w), _) => Ok(axum::Json(w)),
        (Err(_), Some(Cut::Timeout(t))) => Err(HttpError::RequestTimeout(t.to_string())),
        (Err(_), Some(Cut::TooLarge(n))) => Err(HttpError::upload_too_large("file", n, max)),
        (Err(_), Some(Cut::Broken(why))) => Err(HttpError::Api(ApiError::invalid(format!(
            "the upload was cut short: {why}"
        )))),
        (Err(e), None) => Err(e.into()),
    }
}

/// What the backend's thread sends the connection.
enum Piece {
    Start(u64),
    Data(Bytes),
}

/// The response body as a sink for the backend's thread.
struct ChannelSink {
    tx: mpsc::Sender<Piece>,
}

impl ByteSink for ChannelSink {
    fn start(&mut self, size: u64) -> io::Result<()> {
        self.tx
            .blocking_send(Piece::Start(size))
            .map_err(|_| io::Error::other("the client went away"))
    }

    fn write(&mut self, bytes: &[u8]) -> io::Result<()> {
        for piece in bytes.chunks(PIECE) {
            self.tx
                .blocking_send(Piece::Data(Bytes::copy_from_slice(piece)))
                .map_err(|_| io::Error::other("the client went away"))?;
        }
        Ok(())
    }
}

/// `GET /v1/sandboxes/{id}/files?path=PATH`: the file's content as the body
/// (`application/octet-stream`, its `Content-Length` the file's size when the transfer
/// started). An error before the first byte is the usual JSON error; one after it (the file
/// shrank, the sandbox went away) ends the connection before the announced length, so a client
/// never takes a shorter file for the whole one.
pub async fn download(
    State(state): State<AppState>,
    o: Owned,
    ApiQuery(req): ApiQuery<DownloadRequest>,
) -> Result<Response, HttpError> {
    let (tx, mut rx) = mpsc::channel::<Piece>(PIECES);
    let backend = state.backend().clone();
    let id = o.id.clone();
    let mut call = tokio::task::spawn_blocking(move || {
        let mut sink = ChannelSink { tx };
        backend.download(&id, req, &mut sink)
    });
    let size = match rx.recv().await {
        Some(Piece::Start(size)) => size,
        Some(Piece::Data(_)) | None => {
            drop(rx);
            return match (&mut call).await {
                Ok(Ok(_)) => Err(HttpError::Api(ApiError::internal(
                    "the download ended before it started",
                ))),
                Ok(Err(e)) => Err(e.into()),
                Err(e) => Err(HttpError::Api(ApiError::internal(format!(
                    "backend call failed: {e}"
                )))),
            };
        }
    };
    let pieces = futures_util::stream::unfold((rx, Some(call)), |(mut rx, call)| async move {
        match rx.recv().await {
            Some(Piece::Data(b)) => Some((Ok::<Bytes, io::Error>(b), (rx, call))),
            Some(Piece::Start(_)) => Some((Ok(Bytes::new()), (rx, call))),
            None => match call?.await {
                Ok(Ok(_)) => None,
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "a download failed after it started");
                    Some((Err(io::Error::other(e.to_string())), (rx, None)))
                }
                Err(e) => Some((Err(io::Error::other(e.to_string())), (rx, None))),
            },
        }
    });
    Ok((
        StatusCode::OK,
        [
            (header::CONTENT_TYPE, "application/octet-stream".to_string()),
            (header::CONTENT_LENGTH, size.to_string()),
        ],
        Body::from_stream(pieces),
    )
        .into_response())
}
