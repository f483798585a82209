//! The boundary every C entry point goes through: errors and panics become return values and a
//! per-thread message, failures of entry points that return nothing are logged, and arguments
//! from C are checked.

use std::borrow::Cow;
use std::cell::RefCell;
use std::ffi::{c_char, c_int, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::devices::{self, Device};
use crate::Tag;

thread_local! {
    pub(crate) static LAST_ERROR: RefCell<Cow<'static, CStr>> = const { RefCell::new(Cow::Borrowed(c"")) };
    pub(crate) static TAG_STACK: RefCell<Vec<Tag>> = const { RefCell::new(Vec::new()) };
}

/// What the last error reads when the real message could not be recorded.
pub(crate) const UNRECORDED: &CStr =
    c"internal error: the message of a failure could not be recorded";

/// Record this thread's last error. Never panics: when the thread-local is gone (thread exit)
/// or borrowed (a caller still reading the previous message), the message is dropped.
pub(crate) fn set_error(msg: Cow<'static, CStr>) {
    let _ = LAST_ERROR.try_with(|e| {
        if let Ok(mut e) = e.try_borrow_mut() {
            *e = msg;
        }
    });
}

pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("unknown panic")
}

/// Install the library's log output for processes that reach it through the C ABI (a Rust
/// host has its own subscriber, which is kept): stderr, filtered by `VRAM_LEDGER_LOG` (an
/// `EnvFilter` directive such as `debug` or `vram_ledger=info`; warnings and errors when
/// unset). Called where a process starts using the library and on every failure, never on the
/// cached path.
pub(crate) fn ensure_logging() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let filter = tracing_subscriber::EnvFilter::try_from_env("VRAM_LEDGER_LOG")
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .try_init();
    });
}

/// A host's sink for the failures of C entry points: `level` is on Python's `logging` scale (30,
/// a warning), `message` a NUL-terminated UTF-8 string valid during the call.
pub type LogCallback = unsafe extern "C" fn(level: c_int, message: *const c_char);

/// The host's sink, as an address (0: none, the log goes to stderr through `tracing`).
static LOG_CALLBACK: AtomicUsize = AtomicUsize::new(0);

/// Send the failures of C entry points that return nothing (`void`, such as a free) to
/// `callback` instead of stderr (NULL goes back to stderr); the others' failures are in their
/// results. The Python package hands it `logging`. The callback runs on the failing thread,
/// after the failed call has released every lock of the allocator, and must not unwind. The
/// library's own notes on calls that succeeded (a commit that left the KV cache as it was, say)
/// are not failures: they go to stderr, filtered by `VRAM_LEDGER_LOG` (default `warn`; `off`
/// silences them).
#[no_mangle]
pub extern "C" fn vram_ledger_set_log_callback(callback: Option<LogCallback>) {
    LOG_CALLBACK.store(callback.map_or(0, |f| f as usize), Ordering::Release);
}

/// A failure of an entry point, to the host's sink if it gave one, else to the log.
fn report_failure(msg: &str) {
    let f = LOG_CALLBACK.load(Ordering::Acquire);
    if f != 0 {
        // SAFETY: a non-zero value was stored from a `LogCallback` by the setter above.
        let f: LogCallback = unsafe { std::mem::transmute::<usize, LogCallback>(f) };
        let c = CString::new(msg.replace('\0', " ")).unwrap_or_else(|_| UNRECORDED.into());
        // SAFETY: the host's callback, called as its contract says; `c` outlives the call.
        unsafe { f(WARNING, c.as_ptr()) };
        return;
    }
    ensure_logging();
    tracing::warn!("{msg}");
}

/// Python's `logging.WARNING`.
const WARNING: c_int = 30;

/// Run `f`, turning errors and panics into `on_err` and a last-error message. A failure of a
/// `void` entry point, which returns nothing to check, is logged at warn level (to the host's
/// callback if it gave one), so that it is never silent; any other entry point's caller sees
/// the failure in its result and reads the message, so it is logged at debug level only (at
/// warn too, every error a host raised was printed a second time). Building and storing the
/// message runs under `catch_unwind` too: a panic there (an allocation failure, say) leaves
/// the static [`UNRECORDED`] message instead, and never unwinds into C.
pub(crate) fn guard<T: 'static>(on_err: T, f: impl FnOnce() -> Result<T, String>) -> T {
    let void = std::any::TypeId::of::<T>() == std::any::TypeId::of::<()>();
    guard_with(void, on_err, f)
}

/// [`guard`] for an entry point whose caller receives the failure's message itself (a C++
/// exception): it is recorded as the last error and logged at debug level only.
pub(crate) fn guard_unlogged<T>(on_err: T, f: impl FnOnce() -> Result<T, String>) -> T {
    guard_with(false, on_err, f)
}

/// `warn`: the failure goes to the host's sink or the log at warn level; otherwise to the log
/// at debug level.
fn guard_with<T>(warn: bool, on_err: T, f: impl FnOnce() -> Result<T, String>) -> T {
    let run = || {
        let msg = match catch_unwind(AssertUnwindSafe(f)) {
            Ok(Ok(v)) => return Some(v),
            Ok(Err(msg)) => msg,
            Err(panic) => format!(
                "internal error (caught at the C boundary): {}",
                panic_message(&*panic)
            ),
        };
        if warn {
            report_failure(&msg);
        } else {
            ensure_logging();
            tracing::debug!("{msg}");
        }
        let c = CString::new(msg.replace('\0', " ")).unwrap_or_else(|_| UNRECORDED.into());
        set_error(Cow::Owned(c));
        None
    };
    match catch_unwind(AssertUnwindSafe(run)) {
        Ok(Some(v)) => v,
        Ok(None) => on_err,
        Err(payload) => {
            // Dropping a payload runs foreign code that may panic again: leak it instead.
            std::mem::forget(payload);
            set_error(Cow::Borrowed(UNRECORDED));
            on_err
        }
    }
}

/// 0 for success, or the error's message (for entry points that return 0 or -1).
pub(crate) fn status(r: crate::Result<()>) -> Result<c_int, String> {
    r.map(|()| 0).map_err(|e| e.to_string())
}

pub(crate) fn device_index(device: c_int) -> Result<usize, String> {
    usize::try_from(device).map_err(|_| format!("device {device} is not a device ordinal"))
}

/// The device's state, from the registry the Rust API shares.
#[inline]
pub(crate) fn state(device: c_int) -> Result<&'static Device, String> {
    devices::device(device_index(device)?).map_err(|e| e.to_string())
}

/// # Safety
/// `p` is NULL or points to a NUL-terminated string that stays valid and unchanged for `'a`.
pub(crate) unsafe fn c_str<'a>(p: *const c_char, what: &str) -> Result<&'a str, String> {
    if p.is_null() {
        return Err(format!("{what} is NULL"));
    }
    // SAFETY: not NULL (checked above); NUL-terminated and live by this function's contract.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| format!("{what} is not UTF-8"))
}

pub(crate) fn into_c_string(s: String) -> *mut c_char {
    CString::new(s).map_or(std::ptr::null_mut(), CString::into_raw)
}

/// The message of the last failure on this thread ("" if none). Valid until the next failure
/// on this thread, and not after the thread exits: copy it to keep it. Never NULL.
#[no_mangle]
pub extern "C" fn vram_ledger_last_error() -> *const c_char {
    LAST_ERROR
        .try_with(|e| e.try_borrow().map_or(UNRECORDED.as_ptr(), |e| e.as_ptr()))
        .unwrap_or(UNRECORDED.as_ptr())
}

/// Free a string returned by this library. NULL is ignored.
///
/// # Safety
/// `s` is NULL or a string this library returned, not freed before.
#[no_mangle]
pub unsafe extern "C" fn vram_ledger_string_free(s: *mut c_char) {
    if !s.is_null() {
        // SAFETY: `s` came from CString::into_raw in this library.
        drop(unsafe { CString::from_raw(s) });
    }
}

/// The number of this process's devices: CUDA devices, or with `VRAM_LEDGER_DRIVER=sim`
/// simulated ones. 0 without a device; when the backend cannot count them (no driver, or a
/// `VRAM_LEDGER_DRIVER` or `VRAM_LEDGER_SIM_DEVICES` value that names nothing) also 0, and
/// `vram_ledger_last_error` says why.
#[no_mangle]
pub extern "C" fn vram_ledger_device_count() -> c_int {
    guard(0, || {
        let n = devices::try_count().map_err(|e| e.to_string())?;
        Ok(c_int::try_from(n).unwrap_or(c_int::MAX))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn last_error() -> String {
        // SAFETY: never NULL, and valid until the next failure on this thread.
        unsafe { CStr::from_ptr(vram_ledger_last_error()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn a_panic_becomes_the_error_value_and_a_readable_message() {
        assert_eq!(
            guard(-1, || -> Result<i32, String> { panic!("boom {}", 7) }),
            -1
        );
        assert_eq!(
            last_error(),
            "internal error (caught at the C boundary): boom 7"
        );
        let p = guard(std::ptr::null_mut::<c_char>(), || {
            std::panic::panic_any(42u8)
        });
        assert!(p.is_null());
        assert!(last_error().ends_with("unknown panic"), "{}", last_error());
    }

    static SEEN: std::sync::Mutex<Vec<(c_int, String)>> = std::sync::Mutex::new(Vec::new());

    unsafe extern "C" fn sink(level: c_int, message: *const c_char) {
        // SAFETY: the library passes a NUL-terminated string valid during the call.
        let m = unsafe { CStr::from_ptr(message) }
            .to_string_lossy()
            .into_owned();
        SEEN.lock().unwrap().push((level, m));
    }

    #[test]
    fn failures_go_to_the_hosts_callback_when_it_gave_one() {
        vram_ledger_set_log_callback(Some(sink));
        guard((), || Err("routed failure".to_string()));
        // A failure its caller sees in the result is the caller's to report, not the log's.
        assert_eq!(guard(-1, || Err("checked failure".to_string())), -1);
        assert_eq!(last_error(), "checked failure");
        vram_ledger_set_log_callback(None);
        guard((), || Err("unrouted failure".to_string()));
        let seen = SEEN.lock().unwrap();
        assert!(
            seen.contains(&(30, "routed failure".to_string())),
            "{seen:?}"
        );
        for m in ["unrouted failure", "checked failure"] {
            assert!(!seen.iter().any(|(_, s)| s == m), "{m}: {seen:?}");
        }
    }

    #[test]
    fn an_error_message_with_a_nul_is_kept_readable() {
        assert_eq!(guard(-1, || Err("a\0b".to_string())), -1);
        assert_eq!(last_error(), "a b");
    }

    #[test]
    fn recording_while_the_message_is_borrowed_does_not_unwind() {
        assert_eq!(guard(-1, || Err("first".to_string())), -1);
        // A caller still holding the previous message: recording the next one must neither
        // panic across the boundary nor free the string being read.
        let r = LAST_ERROR.with(|e| {
            let held = e.borrow();
            let r = guard(-1, || Err("second".to_string()));
            assert_eq!(held.to_str().unwrap(), "first");
            r
        });
        assert_eq!(r, -1);
        assert_eq!(guard(-1, || Err("third".to_string())), -1);
        assert_eq!(last_error(), "third");
    }
}
