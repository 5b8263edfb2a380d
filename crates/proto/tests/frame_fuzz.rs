//! Fuzzing the frame decoder with arbitrary bytes: the guest writes the
//! stream the host decodes, so whatever it writes must never panic the
//! reader, never make it allocate more than one frame's worth at a time,
//! and never keep it from finding the next good frame.

use proptest::prelude::*;
use shoal_proto::{encode, read_frame, Frame, GuestMsg, ProtoError, MAGIC, MAX_CHUNK, MAX_HEADER};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// Records the largest single allocation made by the thread that armed it.
struct Watch;

thread_local! {
    static ARMED: Cell<bool> = const { Cell::new(false) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    // try_with: the thread-locals may be gone while a thread exits.
    let _ = ARMED.try_with(|armed| {
        if armed.get() {
            let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
        }
    });
}

// SAFETY: every call is passed to the system allocator unchanged.
unsafe impl GlobalAlloc for Watch {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: the caller's contract is the system allocator's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: the caller's contract is the system allocator's.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: the caller's contract is the system allocator's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract is the system allocator's.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Watch = Watch;

/// The most one frame may cost the reader in a single allocation: its body
/// (header and payload) read whole.
const FRAME_BOUND: usize = MAX_HEADER + MAX_CHUNK;

/// Reads frames until the stream ends; the largest allocation seen and the
/// frames decoded.
fn drain(mut bytes: &[u8]) -> (usize, Vec<Frame<GuestMsg>>) {
    LARGEST.with(|l| l.set(0));
    ARMED.with(|a| a.set(true));
    let mut frames = Vec::new();
    loop {
        match read_frame::<GuestMsg, _>(&mut bytes) {
            Ok(frame) => frames.push(frame),
            Err(ProtoError::Closed) => break,
            // A short body reads as an I/O error (unexpected end).
            Err(ProtoError::Io(_)) if bytes.is_empty() => break,
            Err(ProtoError::Io(e)) => panic!("a slice never fails to read: {e}"),
            Err(_) => continue,
        }
    }
    ARMED.with(|a| a.set(false));
    (LARGEST.with(Cell::get), frames)
}

/// Bytes that look like frames: the magic, then lengths (often huge), then
/// a bit of anything.
fn framelike() -> impl Strategy<Value = Vec<u8>> {
    (
        any::<u32>(),
        any::<u32>(),
        prop::collection::vec(any::<u8>(), 0..64),
    )
        .prop_map(|(h, p, tail)| {
            let mut out = MAGIC.to_vec();
            out.extend_from_slice(&h.to_be_bytes());
            out.extend_from_slice(&p.to_be_bytes());
            out.extend_from_slice(&tail);
            out
        })
}

fn guest_msg() -> impl Strategy<Value = GuestMsg> {
    prop_oneof![
        Just(GuestMsg::Stdout),
        Just(GuestMsg::Stderr),
        Just(GuestMsg::Data),
        Just(GuestMsg::End),
        Just(GuestMsg::Pong),
        any::<u32>().prop_map(|pid| GuestMsg::Started { pid }),
        any::<u64>().prop_map(|size| GuestMsg::FileInfo { size }),
        (
            any::<Option<i32>>(),
            any::<bool>(),
            any::<u64>(),
            any::<Option<(u64, u64)>>()
        )
            .prop_map(|(code, timed_out, ms, usage)| GuestMsg::Exit {
                code,
                signal: None,
                timed_out,
                duration_ms: ms,
                usage: usage.map(|(max_rss_kib, cpu_ms)| shoal_proto::ProcessUsage {
                    max_rss_kib,
                    cpu_ms,
                    oom_kills: cpu_ms % 3,
                }),
            }),
        ".{0,40}".prop_map(|message| GuestMsg::Error {
            kind: shoal_proto::ErrorKind::Io,
            message
        }),
    ]
}

fn frame() -> impl Strategy<Value = Frame<GuestMsg>> {
    (
        0u64..(1 << 52),
        guest_msg(),
        prop::collection::vec(any::<u8>(), 0..2048),
    )
        .prop_map(|(id, msg, payload)| Frame::with_payload(id, msg, payload))
}

fn without_magic(bytes: Vec<u8>) -> Vec<u8> {
    // Garbage that holds no whole magic; 'S' only begins the magic, so
    // dropping it is enough.
    bytes.into_iter().filter(|&b| b != MAGIC[0]).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn arbitrary_bytes_never_panic_nor_allocate_past_a_frame(
        bytes in prop::collection::vec(any::<u8>(), 0..4096),
    ) {
        let (largest, _) = drain(&bytes);
        prop_assert!(largest <= FRAME_BOUND, "allocated {largest}");
    }

    #[test]
    fn framelike_garbage_never_panics_nor_allocates_past_a_frame(
        pieces in prop::collection::vec(
            prop_oneof![framelike(), prop::collection::vec(any::<u8>(), 0..32)],
            0..16,
        ),
    ) {
        let bytes: Vec<u8> = pieces.concat();
        let (largest, _) = drain(&bytes);
        prop_assert!(largest <= FRAME_BOUND, "allocated {largest}");
    }

    #[test]
    fn good_frames_are_found_after_garbage(
        parts in prop::collection::vec(
            (prop::collection::vec(any::<u8>(), 0..200), frame()),
            1..8,
        ),
    ) {
        let mut bytes = Vec::new();
        let mut want = Vec::new();
        for (garbage, frame) in parts {
            bytes.extend(without_magic(garbage));
            bytes.extend(encode(&frame));
            want.push(frame);
        }
        let (_, got) = drain(&bytes);
        prop_assert_eq!(got, want);
    }

    #[test]
    fn a_frame_torn_anywhere_is_skipped_to_the_next(
        torn in frame(),
        cut in any::<prop::sample::Index>(),
        next in frame(),
    ) {
        // A frame torn by a snapshot: the new connection sees its tail
        // (from past its magic, which is how a resync happens).
        let whole = encode(&torn);
        let from = 4 + cut.index(whole.len() - 4);
        let mut bytes = without_magic(whole[from..].to_vec());
        bytes.extend(encode(&next));
        let (_, got) = drain(&bytes);
        prop_assert_eq!(got.last(), Some(&next));
    }
}

#[cfg(feature = "tokio")]
mod asynchronous {
    use super::*;

    async fn drain_async(mut bytes: &[u8]) -> Vec<Frame<GuestMsg>> {
        let mut frames = Vec::new();
        loop {
            match shoal_proto::asynchronous::read_frame::<GuestMsg, _>(&mut bytes).await {
                Ok(frame) => frames.push(frame),
                Err(ProtoError::Closed) => break,
                Err(ProtoError::Io(_)) if bytes.is_empty() => break,
                Err(ProtoError::Io(e)) => panic!("a slice never fails to read: {e}"),
                Err(_) => continue,
            }
        }
        frames
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// The host's own (async) reader agrees with the blocking one on
        /// any input.
        #[test]
        fn the_async_reader_decodes_what_the_blocking_one_does(
            pieces in prop::collection::vec(
                prop_oneof![
                    framelike(),
                    prop::collection::vec(any::<u8>(), 0..64),
                    frame().prop_map(|f| encode(&f)),
                ],
                0..12,
            ),
        ) {
            let bytes: Vec<u8> = pieces.concat();
            let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
            let got = runtime.block_on(drain_async(&bytes));
            let (_, want) = drain(&bytes);
            prop_assert_eq!(got, want);
        }
    }
}
