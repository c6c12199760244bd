//! The process's JIT linker: LLVM's ORC LLJIT (through llvm-sys; inkwell wraps only MCJIT, which
//! compiles IR and cannot take object code). Each kernel's object code, freshly compiled or read
//! from the disk cache, is linked into a JITDylib of its own, so kernels of the same name (two
//! vector widths, or a hash8 shared by two kernels) never clash, with the libm functions bound to
//! Rust's implementations and the process's own symbols (memset, memcpy) visible, as MCJIT bound
//! them before.
//!
//! Linked code stays mapped until the process exits: a kernel's address is handed out to every
//! program that uses it (`jit.rs` keeps them by key), so nothing may unmap it while one might run.
//! A kernel is a few pages; a process compiles a few hundred distinct ones at most.

use std::ffi::{c_char, c_void, CStr, CString};
use std::ptr;
use std::sync::{mpsc, Mutex, OnceLock};

use inkwell::llvm_sys::core::LLVMCreateMemoryBufferWithMemoryRangeCopy;
use inkwell::llvm_sys::error::{LLVMDisposeErrorMessage, LLVMErrorRef, LLVMGetErrorMessage};
use inkwell::llvm_sys::orc2::lljit::{
    LLVMOrcCreateLLJIT, LLVMOrcLLJITAddObjectFile, LLVMOrcLLJITGetExecutionSession, LLVMOrcLLJITGetGlobalPrefix,
    LLVMOrcLLJITMangleAndIntern, LLVMOrcLLJITRef,
};
use inkwell::llvm_sys::orc2::{
    LLVMJITEvaluatedSymbol, LLVMJITSymbolFlags, LLVMJITSymbolGenericFlags, LLVMOrcAbsoluteSymbols, LLVMOrcCJITDylibSearchOrderElement,
    LLVMOrcCLookupSetElement, LLVMOrcCSymbolMapPair, LLVMOrcCSymbolMapPairs, LLVMOrcCreateDynamicLibrarySearchGeneratorForProcess,
    LLVMOrcDisposeMaterializationUnit, LLVMOrcExecutionSessionCreateBareJITDylib, LLVMOrcExecutionSessionLookup,
    LLVMOrcExecutionSessionRef, LLVMOrcJITDylibAddGenerator, LLVMOrcJITDylibClear, LLVMOrcJITDylibDefine, LLVMOrcJITDylibLookupFlags,
    LLVMOrcJITDylibRef, LLVMOrcLookupKind, LLVMOrcSymbolLookupFlags,
};
use inkwell::targets::{InitializationConfig, Target};

extern "C" fn qatc_tanhf(x: f32) -> f32 {
    x.tanh()
}
extern "C" fn qatc_tanh(x: f64) -> f64 {
    x.tanh()
}
extern "C" fn qatc_logf(x: f32) -> f32 {
    x.ln()
}
extern "C" fn qatc_log(x: f64) -> f64 {
    x.ln()
}
extern "C" fn qatc_exp(x: f64) -> f64 {
    x.exp()
}
extern "C" fn qatc_powf(x: f32, y: f32) -> f32 {
    x.powf(y)
}
extern "C" fn qatc_pow(x: f64, y: f64) -> f64 {
    x.powf(y)
}

/// The libm functions kernels call, bound to Rust's (the interpreter's) implementations so both
/// sides round the same way.
fn externs() -> [(&'static str, usize); 7] {
    [
        ("tanhf", qatc_tanhf as extern "C" fn(f32) -> f32 as usize),
        ("tanh", qatc_tanh as extern "C" fn(f64) -> f64 as usize),
        ("logf", qatc_logf as extern "C" fn(f32) -> f32 as usize),
        ("log", qatc_log as extern "C" fn(f64) -> f64 as usize),
        ("exp", qatc_exp as extern "C" fn(f64) -> f64 as usize),
        ("powf", qatc_powf as extern "C" fn(f32, f32) -> f32 as usize),
        ("pow", qatc_pow as extern "C" fn(f64, f64) -> f64 as usize),
    ]
}

/// The process's LLJIT.
pub(crate) struct Orc {
    jit: LLVMOrcLLJITRef,
    /// Serializes linking (ORC's session is thread-safe itself; the lock keeps the reasoning
    /// about the calls below local) and counts the JITDylibs made, whose names must be distinct.
    dylibs: Mutex<u64>,
}

// SAFETY: the LLJIT is created once and never disposed (it lives as long as the process, like
// the code it links); every use goes through `link`, which holds `dylibs`' lock, so no two
// threads call into it at once.
unsafe impl Send for Orc {}
// SAFETY: as above.
unsafe impl Sync for Orc {}

static ORC: OnceLock<Result<Orc, String>> = OnceLock::new();

/// The message of an LLVM error, which this consumes; None for success.
fn take(e: LLVMErrorRef) -> Option<String> {
    if e.is_null() {
        return None;
    }
    // SAFETY: `e` is a non-null error LLVM returned to us and nothing else holds; getting its
    // message consumes it, and the message is disposed of once copied.
    unsafe {
        let m = LLVMGetErrorMessage(e);
        let s = CStr::from_ptr(m).to_string_lossy().into_owned();
        LLVMDisposeErrorMessage(m);
        Some(s)
    }
}

fn check(e: LLVMErrorRef) -> Result<(), String> {
    take(e).map_or(Ok(()), Err)
}

impl Orc {
    /// The process's LLJIT, created at the first call.
    pub(crate) fn get() -> Result<&'static Orc, String> {
        ORC.get_or_init(Orc::new).as_ref().map_err(Clone::clone)
    }

    fn new() -> Result<Orc, String> {
        Target::initialize_native(&InitializationConfig::default())?;
        let mut jit: LLVMOrcLLJITRef = ptr::null_mut();
        // SAFETY: a null builder asks for LLJIT's defaults (this host, JITLink); `jit` is
        // written when it succeeds.
        check(unsafe { LLVMOrcCreateLLJIT(&mut jit, ptr::null_mut()) })?;
        Ok(Orc { jit, dylibs: Mutex::new(0) })
    }

    /// Links `object` (an ELF object defining the function `symbol`) into a JITDylib of its own
    /// and returns the function's address. The code stays mapped until the process exits.
    pub(crate) fn link(&self, symbol: &str, object: &[u8]) -> Result<usize, String> {
        let mut made = self.dylibs.lock().map_err(|_| "a thread panicked while linking a kernel".to_string())?;
        *made += 1;
        let name = CString::new(format!("{symbol}#{made}")).map_err(|e| e.to_string())?;
        let c_symbol = CString::new(symbol).map_err(|e| e.to_string())?;
        // SAFETY: `self.jit` is a live LLJIT (never disposed); the session and the JITDylib it
        // returns live as long. The name is copied.
        let (es, jd) = unsafe {
            let es = LLVMOrcLLJITGetExecutionSession(self.jit);
            (es, LLVMOrcExecutionSessionCreateBareJITDylib(es, name.as_ptr()))
        };
        // SAFETY: `jd` was just created in this session, and this thread holds the lock.
        let r = unsafe { self.fill(jd, &name, object).and_then(|()| lookup(es, jd, self.jit, &c_symbol)) };
        if r.is_err() {
            // what a failed link left in the JITDylib goes; the JITDylib itself (a name) stays
            // SAFETY: as above; nothing in `jd` is in use, since its lookup failed.
            let _ = take(unsafe { LLVMOrcJITDylibClear(jd) });
        }
        r
    }

    /// Defines the externs in `jd`, lets it see the process's symbols, and adds the object.
    ///
    /// # Safety
    /// `jd` must be a JITDylib of this LLJIT's session, and the caller must hold `dylibs`' lock.
    unsafe fn fill(&self, jd: LLVMOrcJITDylibRef, name: &CStr, object: &[u8]) -> Result<(), String> {
        let flags = || LLVMJITSymbolFlags {
            GenericFlags: LLVMJITSymbolGenericFlags::LLVMJITSymbolGenericFlagsExported as u8
                | LLVMJITSymbolGenericFlags::LLVMJITSymbolGenericFlagsCallable as u8,
            TargetFlags: 0,
        };
        let mut pairs = Vec::new();
        for (sym, addr) in externs() {
            let c = CString::new(sym).map_err(|e| e.to_string())?;
            // SAFETY: the LLJIT is live; the name is copied into its pool, and the entry returned
            // (retained for us) is handed to LLVMOrcAbsoluteSymbols, which takes it.
            let interned = unsafe { LLVMOrcLLJITMangleAndIntern(self.jit, c.as_ptr()) };
            pairs.push(LLVMOrcCSymbolMapPair { Name: interned, Sym: LLVMJITEvaluatedSymbol { Address: addr as u64, Flags: flags() } });
        }
        // SAFETY: `pairs` holds `pairs.len()` initialized elements whose names are retained for
        // this call (it takes them; the array itself stays ours and is dropped below).
        let mu = unsafe { LLVMOrcAbsoluteSymbols(pairs.as_mut_ptr(), pairs.len()) };
        // SAFETY: `jd` is live (the caller's contract); on success it owns `mu`, on failure we
        // still do and dispose of it.
        if let Some(e) = take(unsafe { LLVMOrcJITDylibDefine(jd, mu) }) {
            // SAFETY: `mu` was not taken (the define failed) and is not used again.
            unsafe { LLVMOrcDisposeMaterializationUnit(mu) };
            return Err(e);
        }
        let mut generator = ptr::null_mut();
        // SAFETY: the LLJIT is live; no filter, so the generator sees every process symbol, as
        // MCJIT did (inkwell's load_visible_symbols); it is written on success.
        check(unsafe {
            LLVMOrcCreateDynamicLibrarySearchGeneratorForProcess(
                &mut generator,
                LLVMOrcLLJITGetGlobalPrefix(self.jit),
                None,
                ptr::null_mut(),
            )
        })?;
        // SAFETY: `jd` is live and takes the generator it is given.
        unsafe { LLVMOrcJITDylibAddGenerator(jd, generator) };
        // SAFETY: the range is `object`, which LLVM copies; the name is copied too.
        let buf = unsafe { LLVMCreateMemoryBufferWithMemoryRangeCopy(object.as_ptr().cast::<c_char>(), object.len(), name.as_ptr()) };
        // SAFETY: the LLJIT and `jd` are live; the JIT takes the buffer whatever the outcome.
        check(unsafe { LLVMOrcLLJITAddObjectFile(self.jit, jd, buf) })
    }
}

/// What a lookup's handler sends back: the address, or LLVM's message.
type Found = Result<usize, String>;

extern "C" fn found(err: LLVMErrorRef, result: LLVMOrcCSymbolMapPairs, n: usize, ctx: *mut c_void) {
    let r = match take(err) {
        Some(e) => Err(e),
        // SAFETY: on success `result` points to `n` pairs, valid during this call.
        None if n >= 1 && !result.is_null() => Ok(unsafe { (*result).Sym.Address } as usize),
        None => Err("the lookup found nothing".to_string()),
    };
    // SAFETY: `ctx` is the boxed `Sender` `lookup` leaked for this handler, which ORC calls
    // exactly once: it is taken back (and dropped) here and nowhere else.
    let tx = unsafe { Box::from_raw(ctx.cast::<mpsc::Sender<Found>>()) };
    let _ = tx.send(r);
}

/// The address of `symbol` in `jd` (which links the JITDylib's object code).
///
/// # Safety
/// `es`, `jd` and `jit` must be live and belong together.
unsafe fn lookup(es: LLVMOrcExecutionSessionRef, jd: LLVMOrcJITDylibRef, jit: LLVMOrcLLJITRef, symbol: &CStr) -> Result<usize, String> {
    let mut order = [LLVMOrcCJITDylibSearchOrderElement {
        JD: jd,
        JDLookupFlags: LLVMOrcJITDylibLookupFlags::LLVMOrcJITDylibLookupFlagsMatchExportedSymbolsOnly,
    }];
    // SAFETY: the LLJIT is live; the entry returned is retained for us and handed to the lookup,
    // which takes it.
    let name = unsafe { LLVMOrcLLJITMangleAndIntern(jit, symbol.as_ptr()) };
    let mut set = [LLVMOrcCLookupSetElement { Name: name, LookupFlags: LLVMOrcSymbolLookupFlags::LLVMOrcSymbolLookupFlagsRequiredSymbol }];
    let (tx, rx) = mpsc::channel::<Found>();
    // the handler owns its sender (it may run on another thread, after this returns)
    let ctx = Box::into_raw(Box::new(tx)).cast::<c_void>();
    // SAFETY: both arrays hold exactly the counts given and outlive the call; `ctx` is a leaked
    // box the handler takes back.
    unsafe {
        LLVMOrcExecutionSessionLookup(
            es,
            LLVMOrcLookupKind::LLVMOrcLookupKindStatic,
            order.as_mut_ptr(),
            order.len(),
            set.as_mut_ptr(),
            set.len(),
            found,
            ctx,
        )
    };
    rx.recv().map_err(|_| "the JIT never answered a lookup".to_string())?
}
