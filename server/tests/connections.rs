//! Limits on HTTP connections, which hold before any key is known: a request head sent
//! too slowly, a request body that stalls, and more connections than the server takes
//! at once. Raw TCP clients play the hostile peer.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::http::*;
use lathe_server::api::listener::ConnectionLimits;

fn connect(server: &TestServer) -> TcpStream {
    TcpStream::connect(server.url.trim_start_matches("http://")).unwrap()
}

/// What the server sends before it closes `stream` (waiting at most `within`), and
/// how long that took.
fn read_until_closed(stream: &mut TcpStream, within: Duration) -> (String, Duration) {
    let started = Instant::now();
    stream.set_read_timeout(Some(within)).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::ConnectionReset => break,
            Err(e) => panic!("the server neither answered nor closed within {within:?}: {e}"),
        }
    }
    (
        String::from_utf8_lossy(&got).into_owned(),
        started.elapsed(),
    )
}

const HEALTHZ: &[u8] = b"GET /api/v1/healthz HTTP/1.1\r\nHost: lathe\r\nConnection: close\r\n\r\n";

/// The server answers a whole request on a fresh connection.
fn assert_served(server: &TestServer) {
    let mut whole = connect(server);
    whole.write_all(HEALTHZ).unwrap();
    let (answer, _) = read_until_closed(&mut whole, Duration::from_secs(10));
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

/// A server (data dir tagged `tag`) with the default connection limits changed by
/// `tweak`.
fn serve_with(tag: &str, tweak: impl FnOnce(&mut ConnectionLimits)) -> TestServer {
    let dir = temp_dir(tag);
    TestServer::start(&dir, |c| tweak(&mut c.connections))
}

/// Stops `server` and removes its data dir.
fn finish(server: TestServer) {
    let dir = server.data_dir.clone();
    server.stop();
    let _ = std::fs::remove_dir_all(dir);
}

/// Half a request head, then silence (slowloris): the connection is closed once the
/// head deadline passes, and the server answers a whole request afterwards; a
/// keep-alive connection left idle after its answer closes after as long.
#[test]
fn a_request_head_sent_too_slowly_is_cut_off() {
    let server = serve_with("conn-head", |l| l.header_timeout = Duration::from_secs(1));
    let mut slow = connect(&server);
    slow.write_all(b"GET /api/v1/healthz HTTP/1.1\r\nHo")
        .unwrap();
    let (_, took) = read_until_closed(&mut slow, Duration::from_secs(10));
    assert!(
        took >= Duration::from_millis(900),
        "closed after {took:?}, before the deadline"
    );
    assert_served(&server);
    let mut kept = connect(&server);
    kept.write_all(b"GET /api/v1/healthz HTTP/1.1\r\nHost: lathe\r\n\r\n")
        .unwrap();
    let (answer, idle) = read_until_closed(&mut kept, Duration::from_secs(10));
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        idle >= Duration::from_millis(900),
        "the idle connection closed after {idle:?}"
    );
    finish(server);
}

/// A request body that stops arriving fails its request once the stall limit passes;
/// the server is not held.
#[test]
fn a_request_body_that_stalls_is_cut_off() {
    let server = serve_with("conn-body", |l| l.stall_timeout = Duration::from_secs(1));
    let mut stalled = connect(&server);
    let head = format!(
        "POST /api/v1/create_session HTTP/1.1\r\nHost: lathe\r\nX-API-Key: {KEY_A}\r\n\
         Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{\"tags\": "
    );
    stalled.write_all(head.as_bytes()).unwrap();
    let (answer, took) = read_until_closed(&mut stalled, Duration::from_secs(10));
    assert!(
        took >= Duration::from_millis(900),
        "answered after {took:?}, before the stall limit: {answer}"
    );
    assert!(
        answer.starts_with("HTTP/1.1 408"),
        "a stalled body answers 408 (which the SDKs retry): {answer}"
    );
    assert!(
        answer.contains(r#""code":"request_timeout""#),
        "with a JSON body: {answer}"
    );
    assert_served(&server);
    finish(server);
}

/// With every connection slot taken, a new connection waits (its request unanswered)
/// until one closes, then is served.
#[test]
fn connections_past_the_limit_wait_for_a_free_slot() {
    let server = serve_with("conn-limit", |l| l.max_connections = 2);
    let first = connect(&server);
    let _second = connect(&server);
    // Let the server take both before the third arrives.
    std::thread::sleep(Duration::from_millis(200));
    let mut third = connect(&server);
    third.write_all(HEALTHZ).unwrap();
    third
        .set_read_timeout(Some(Duration::from_millis(700)))
        .unwrap();
    let mut buf = [0u8; 64];
    match third.read(&mut buf) {
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
        other => panic!("a third connection was served past the limit of 2: {other:?}"),
    }
    drop(first);
    let (answer, _) = read_until_closed(&mut third, Duration::from_secs(10));
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    finish(server);
}

/// An answer its client does not read holds its key's budget (`--max-answer-bytes`):
/// the key's next retrieval is refused with a 429 naming the limit (the result stays
/// retrievable), its control calls and another key are served, and once the answer has
/// been read the key retrieves again.
#[test]
fn an_unread_answer_holds_its_keys_budget_until_it_is_read() {
    let dir = temp_dir("conn-answers");
    let server = TestServer::start(&dir, |c| c.max_answer_bytes = 1 << 20);
    let a = server.client(KEY_A);
    let session = a.session();
    let model = a.create_model(&session, 0, 4, 1);
    // Per-token outputs of 400 sequences: a few MB of JSON.
    let tokens: Vec<i64> = (0..255).map(|i| i % 200).collect();
    let data = (0..400)
        .map(|_| ce_datum(&tokens[..254], &tokens[1..]))
        .collect();
    let id = a.ok("/api/v1/forward", &forward_body(&model, 1, data))["request_id"]
        .as_str()
        .unwrap()
        .to_string();
    // Finished and read once; it stays retrievable for a minute.
    let whole = a.wait(&id).unwrap();
    let size = serde_json::to_vec(&whole).unwrap().len();
    assert!(
        size > 3 << 20,
        "an answer of {size} bytes is too small to test"
    );
    let body = serde_json::json!({ "request_id": id }).to_string();
    let mut unread = connect(&server);
    write!(
        unread,
        "POST /api/v1/retrieve_future HTTP/1.1\r\nHost: lathe\r\nX-API-Key: {KEY_A}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // Its answer is written and handed to the connection before anything else is sent.
    std::thread::sleep(Duration::from_millis(500));
    let retrieve = |c: &Client| {
        c.post(
            "/api/v1/retrieve_future",
            &serde_json::json!({"request_id": id}),
        )
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, v) = retrieve(&a);
        if status == 429 {
            assert_eq!(v["limit"], "max_answer_bytes", "{v}");
            break;
        }
        assert_eq!(status, 200, "{v}");
        assert!(
            Instant::now() < deadline,
            "the unread answer never held the budget"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let (status, v) = a.post(
        "/api/v1/session_heartbeat",
        &serde_json::json!({"session_id": session}),
    );
    assert_eq!(status, 200, "a control call: {v}");
    assert_eq!(
        server
            .client(KEY_B)
            .get("/api/v1/get_server_capabilities")
            .0,
        200,
        "another key"
    );
    let (answer, _) = read_until_closed(&mut unread, Duration::from_secs(60));
    assert!(
        answer.starts_with("HTTP/1.1 200"),
        "{}",
        &answer[..answer.len().min(200)]
    );
    assert!(answer.len() > size, "the whole answer arrives");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, v) = retrieve(&a);
        if status == 200 {
            assert_eq!(v, whole, "the refused result is still there");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the read answer still holds the budget"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    finish(server);
}

/// The store routes (listings, deletes, publishing, TTL changes) read a request's body
/// before taking a store slot (`api::STORE_SLOTS`, `STORE_SLOTS_PER_KEY` of them one
/// key's): the gate is on the real routes (a listing, which reads no body otherwise, is
/// refused with a JSON 413 for a body past the control limit), a body that stalls
/// there gets the JSON 408 the SDKs retry, and key A's bodies still arriving, a share's
/// worth, leave key B's listing unhindered; each held request is answered once its body
/// arrives.
#[test]
fn store_requests_read_their_bodies_before_taking_a_slot() {
    use lathe_server::api::{CONTROL_BODY_BYTES, STORE_SLOTS_PER_KEY};
    let server = serve_with("conn-store", |l| l.stall_timeout = Duration::from_secs(3));
    let b = server.client(KEY_B);
    let mut listing = connect(&server);
    let big = CONTROL_BODY_BYTES + 1;
    write!(
        listing,
        "GET /api/v1/checkpoints HTTP/1.1\r\nHost: lathe\r\nX-API-Key: {KEY_B}\r\n\
         Content-Length: {big}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let (answer, _) = read_until_closed(&mut listing, Duration::from_secs(10));
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains(r#""code":"payload_too_large""#), "{answer}");

    let body = r#"{"ttl_seconds": 60}"#;
    let (first, rest) = body.split_at(5);
    let ttl_head = |i: usize| {
        format!(
            "PUT /api/v1/training_runs/run-{i}/checkpoints/weights/w/ttl HTTP/1.1\r\n\
             Host: lathe\r\nX-API-Key: {KEY_A}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{first}",
            body.len()
        )
    };
    let mut stalled = connect(&server);
    stalled.write_all(ttl_head(99).as_bytes()).unwrap();
    let (answer, _) = read_until_closed(&mut stalled, Duration::from_secs(20));
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains(r#""code":"request_timeout""#), "{answer}");

    let mut held: Vec<TcpStream> = (0..STORE_SLOTS_PER_KEY)
        .map(|i| {
            let mut held = connect(&server);
            held.write_all(ttl_head(i).as_bytes()).unwrap();
            held
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let started = Instant::now();
    let (status, v) = b.get("/api/v1/checkpoints");
    assert_eq!(status, 200, "B's listing: {v}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "B's listing waited {:?} behind A's bodies still arriving",
        started.elapsed()
    );
    for stream in &mut held {
        stream.write_all(rest.as_bytes()).unwrap();
        let (answer, _) = read_until_closed(stream, Duration::from_secs(10));
        assert!(
            answer.starts_with("HTTP/1.1 404"),
            "the TTL of a run that does not exist: {answer}"
        );
    }
    finish(server);
}
