//! The function builder: one kernel's LLVM function under construction, with the pieces every
//! body needs (typed loads and stores by buffer dtype, counted loops, allocas, intrinsics).

use inkwell::attributes::{Attribute, AttributeLoc};
use inkwell::basic_block::BasicBlock;
use inkwell::builder::{Builder, BuilderError};
use inkwell::context::Context;
use inkwell::intrinsics::Intrinsic;
use inkwell::module::{Linkage, Module};
use inkwell::types::{BasicType, BasicTypeEnum};
use inkwell::values::{BasicMetadataValueEnum, BasicValueEnum, FloatValue, FunctionValue, IntValue, PointerValue};
use inkwell::{AddressSpace, FloatPredicate, IntPredicate};
use qatc_ir::DType;

use crate::error::KernelError;
use crate::kir::{Kernel, Ty};

impl From<BuilderError> for KernelError {
    fn from(e: BuilderError) -> Self {
        KernelError::Llvm { kernel: String::new(), message: e.to_string() }
    }
}

pub(crate) type R<T> = Result<T, KernelError>;

pub(crate) struct FnBuilder<'a, 'ctx> {
    pub cx: &'ctx Context,
    pub m: &'a Module<'ctx>,
    pub b: Builder<'ctx>,
    pub k: &'a Kernel,
    pub name: String,
    /// `NAME.body(ptr noalias p0, .., i64 start, i64 end)`.
    pub f: FunctionValue<'ctx>,
    pub params: Vec<PointerValue<'ctx>>,
    pub start: IntValue<'ctx>,
    pub end: IntValue<'ctx>,
    /// Holds the allocas; branches to the code at `finish`.
    allocas: BasicBlock<'ctx>,
    code: BasicBlock<'ctx>,
}

impl<'a, 'ctx> FnBuilder<'a, 'ctx> {
    pub fn new(cx: &'ctx Context, m: &'a Module<'ctx>, k: &'a Kernel, name: &str) -> R<FnBuilder<'a, 'ctx>> {
        let ptr = cx.ptr_type(AddressSpace::default());
        let i64t = cx.i64_type();
        let mut args: Vec<inkwell::types::BasicMetadataTypeEnum> = k.params.iter().map(|_| ptr.into()).collect();
        args.push(i64t.into());
        args.push(i64t.into());
        let f = m.add_function(&format!("{name}.body"), cx.void_type().fn_type(&args, false), Some(Linkage::Internal));
        let noalias = cx.create_enum_attribute(Attribute::get_named_enum_kind_id("noalias"), 0);
        for (p, param) in k.params.iter().enumerate() {
            f.add_attribute(AttributeLoc::Param(p as u32), noalias);
            // the whole buffer is there (the runtime checks sizes): loads of loop-invariant
            // scalars (AdamW's step, the learning rate) may be hoisted out of conditional code
            let bytes = param.dtype.bytes_for(param.numel()) as u64;
            if bytes > 0 {
                f.add_attribute(
                    AttributeLoc::Param(p as u32),
                    cx.create_enum_attribute(Attribute::get_named_enum_kind_id("dereferenceable"), bytes),
                );
            }
        }
        let b = cx.create_builder();
        let allocas = cx.append_basic_block(f, "allocas");
        let code = cx.append_basic_block(f, "code");
        b.position_at_end(code);
        let params = (0..k.params.len()).filter_map(|p| f.get_nth_param(p as u32)).map(|v| v.into_pointer_value()).collect();
        let n = k.params.len() as u32;
        let get =
            |i: u32| f.get_nth_param(i).map(|v| v.into_int_value()).ok_or_else(|| KernelError::Internal("missing range param".into()));
        let (start, end) = (get(n)?, get(n + 1)?);
        Ok(FnBuilder { cx, m, b, k, name: name.to_string(), f, params, start, end, allocas, code })
    }

    /// Closes the body and adds the exported wrapper `NAME(ptr args, i64 start, i64 end)`.
    pub fn finish(&mut self) -> R<()> {
        self.b.build_return(None)?;
        self.b.position_at_end(self.allocas);
        self.b.build_unconditional_branch(self.code)?;
        let ptr = self.cx.ptr_type(AddressSpace::default());
        let i64t = self.cx.i64_type();
        let ty = self.cx.void_type().fn_type(&[ptr.into(), i64t.into(), i64t.into()], false);
        let w = self.m.add_function(&self.name, ty, None);
        let bb = self.cx.append_basic_block(w, "entry");
        self.b.position_at_end(bb);
        let arg = |i: u32| w.get_nth_param(i).ok_or_else(|| KernelError::Internal("missing wrapper param".into()));
        let args_ptr = arg(0)?.into_pointer_value();
        let mut call: Vec<BasicMetadataValueEnum> = Vec::new();
        for p in 0..self.k.params.len() {
            // SAFETY: not Rust-unsafe; inkwell marks GEP unsafe because an out-of-bounds index
            // is UB in the generated code. `args` holds one pointer per param.
            let slot = unsafe { self.b.build_gep(ptr, args_ptr, &[i64t.const_int(p as u64, false)], "slot")? };
            call.push(self.b.build_load(ptr, slot, "p")?.into());
        }
        call.push(arg(1)?.into());
        call.push(arg(2)?.into());
        self.b.build_call(self.f, &call, "")?;
        self.b.build_return(None)?;
        Ok(())
    }

    pub fn f32t(&self) -> inkwell::types::FloatType<'ctx> {
        self.cx.f32_type()
    }

    pub fn llty(&self, t: Ty) -> BasicTypeEnum<'ctx> {
        match t {
            Ty::F32 => self.cx.f32_type().into(),
            Ty::F64 => self.cx.f64_type().into(),
            Ty::I32 => self.cx.i32_type().into(),
            Ty::I64 => self.cx.i64_type().into(),
            Ty::Bool => self.cx.bool_type().into(),
        }
    }

    pub fn index_ty(&self) -> inkwell::types::IntType<'ctx> {
        if self.k.index_ty == Ty::I64 {
            self.cx.i64_type()
        } else {
            self.cx.i32_type()
        }
    }

    pub fn f32c(&self, v: f64) -> FloatValue<'ctx> {
        self.cx.f32_type().const_float(v)
    }

    /// A stack slot in the function's first block (so LLVM promotes it to a register).
    pub fn alloca(&self, ty: BasicTypeEnum<'ctx>, count: u32, name: &str) -> R<PointerValue<'ctx>> {
        let here = self.b.get_insert_block().ok_or_else(|| KernelError::Internal("builder has no block".into()))?;
        self.b.position_at_end(self.allocas);
        let slot = if count == 1 { self.b.build_alloca(ty, name)? } else { self.b.build_alloca(ty.array_type(count), name)? };
        self.b.position_at_end(here);
        Ok(slot)
    }

    /// Element `i` of an array of `ty` at `base`.
    pub fn gep(&self, ty: impl BasicType<'ctx>, base: PointerValue<'ctx>, i: IntValue<'ctx>) -> R<PointerValue<'ctx>> {
        // SAFETY: inkwell marks GEP unsafe for the generated code's sake; the kernel IR's
        // indices are in bounds of the buffers the runtime passes.
        Ok(unsafe { self.b.build_in_bounds_gep(ty, base, &[i], "at")? })
    }

    pub fn load_f32(&self, base: PointerValue<'ctx>, i: IntValue<'ctx>) -> R<FloatValue<'ctx>> {
        let p = self.gep(self.f32t(), base, i)?;
        Ok(self.b.build_load(self.f32t(), p, "x")?.into_float_value())
    }

    pub fn store_f32(&self, base: PointerValue<'ctx>, i: IntValue<'ctx>, v: FloatValue<'ctx>) -> R<()> {
        let p = self.gep(self.f32t(), base, i)?;
        self.b.build_store(p, v)?;
        Ok(())
    }

    /// Element `i` of param `p`, widened: floats to f32, codes to i32 (see `kir`'s rules).
    pub fn load(&self, p: usize, i: IntValue<'ctx>) -> R<BasicValueEnum<'ctx>> {
        let base = self.param(p)?;
        let (cx, b) = (self.cx, &self.b);
        let i32t = cx.i32_type();
        Ok(match self.k.params[p].dtype {
            DType::F32 => self.load_f32(base, i)?.into(),
            DType::F16 => {
                let h = b.build_load(cx.f16_type(), self.gep(cx.f16_type(), base, i)?, "h")?.into_float_value();
                b.build_float_ext(h, cx.f32_type(), "x")?.into()
            }
            DType::BF16 => {
                let h = b.build_load(cx.i16_type(), self.gep(cx.i16_type(), base, i)?, "h")?.into_int_value();
                let w = b.build_int_z_extend(h, i32t, "w")?;
                let w = b.build_left_shift(w, i32t.const_int(16, false), "w")?;
                b.build_bit_cast(w, cx.f32_type(), "x")?
            }
            DType::I32 => b.build_load(i32t, self.gep(i32t, base, i)?, "c")?,
            DType::U8 => {
                let c = b.build_load(cx.i8_type(), self.gep(cx.i8_type(), base, i)?, "c")?.into_int_value();
                b.build_int_z_extend(c, i32t, "c")?.into()
            }
            DType::I4 => {
                let it = i.get_type();
                let byte = b.build_right_shift(i, it.const_int(1, false), false, "byte")?;
                let c = b.build_load(cx.i8_type(), self.gep(cx.i8_type(), base, byte)?, "c")?.into_int_value();
                let c = b.build_int_z_extend(c, i32t, "c")?;
                let odd = b.build_and(i, it.const_int(1, false), "odd")?;
                let odd = b.build_int_truncate_or_bit_cast(odd, i32t, "odd")?;
                let shift = b.build_left_shift(odd, i32t.const_int(2, false), "shift")?;
                let c = b.build_right_shift(c, shift, false, "c")?;
                b.build_and(c, i32t.const_int(15, false), "code")?.into()
            }
        })
    }

    /// param[i] = v, rounded to the param's dtype (v is f32 for float params, i32 for codes).
    pub fn store(&self, p: usize, i: IntValue<'ctx>, v: BasicValueEnum<'ctx>) -> R<()> {
        let base = self.param(p)?;
        let (cx, b) = (self.cx, &self.b);
        match self.k.params[p].dtype {
            DType::F32 => self.store_f32(base, i, v.into_float_value())?,
            DType::F16 => {
                let h = b.build_float_trunc(v.into_float_value(), cx.f16_type(), "h")?;
                b.build_store(self.gep(cx.f16_type(), base, i)?, h)?;
            }
            DType::BF16 => {
                let h = crate::llvm::math::f32_to_bf16_bits(self, v.into_float_value())?;
                b.build_store(self.gep(cx.i16_type(), base, i)?, h)?;
            }
            DType::I32 => {
                b.build_store(self.gep(cx.i32_type(), base, i)?, v.into_int_value())?;
            }
            DType::U8 => {
                let c = b.build_int_truncate(v.into_int_value(), cx.i8_type(), "c")?;
                b.build_store(self.gep(cx.i8_type(), base, i)?, c)?;
            }
            DType::I4 => {
                // two elements share a byte and may be stored by different threads (a store's
                // index need not be its iteration's): clear our nibble, then set it, each an
                // atomic read-modify-write that leaves the other nibble's bits alone
                let it = i.get_type();
                let i8t = cx.i8_type();
                let byte = b.build_right_shift(i, it.const_int(1, false), false, "byte")?;
                let at = self.gep(i8t, base, byte)?;
                let odd = b.build_and(i, it.const_int(1, false), "odd")?;
                let odd = b.build_int_truncate_or_bit_cast(odd, i8t, "odd")?;
                let shift = b.build_left_shift(odd, i8t.const_int(2, false), "shift")?;
                let code = b.build_int_truncate(v.into_int_value(), i8t, "code")?;
                let code = b.build_and(code, i8t.const_int(15, false), "code")?;
                let code = b.build_left_shift(code, shift, "code")?;
                let mask = b.build_left_shift(i8t.const_int(15, false), shift, "mask")?;
                let ord = inkwell::AtomicOrdering::Monotonic;
                b.build_atomicrmw(inkwell::AtomicRMWBinOp::And, at, b.build_not(mask, "keep")?, ord)?;
                b.build_atomicrmw(inkwell::AtomicRMWBinOp::Or, at, code, ord)?;
            }
        }
        Ok(())
    }

    /// param[i] += v atomically (an i32 count: `kir` allows atomics for integers only).
    pub fn atomic_add(&self, p: usize, i: IntValue<'ctx>, v: IntValue<'ctx>) -> R<()> {
        let base = self.param(p)?;
        let at = self.gep(self.cx.i32_type(), base, i)?;
        self.b.build_atomicrmw(inkwell::AtomicRMWBinOp::Add, at, v, inkwell::AtomicOrdering::Monotonic)?;
        Ok(())
    }

    pub fn param(&self, p: usize) -> R<PointerValue<'ctx>> {
        self.params.get(p).copied().ok_or_else(|| KernelError::Internal(format!("{}: no param {p}", self.name)))
    }

    /// `for i in lo..hi { body(i) }`, i of lo's type.
    pub fn for_range(&mut self, lo: IntValue<'ctx>, hi: IntValue<'ctx>, body: &mut dyn FnMut(&mut Self, IntValue<'ctx>) -> R<()>) -> R<()> {
        let pre = self.b.get_insert_block().ok_or_else(|| KernelError::Internal("no block".into()))?;
        let head = self.cx.append_basic_block(self.f, "loop");
        let bb = self.cx.append_basic_block(self.f, "loop.body");
        let exit = self.cx.append_basic_block(self.f, "loop.end");
        self.b.build_unconditional_branch(head)?;
        self.b.position_at_end(head);
        let i = self.b.build_phi(lo.get_type(), "i")?;
        i.add_incoming(&[(&lo, pre)]);
        let iv = i.as_basic_value().into_int_value();
        let go = self.b.build_int_compare(IntPredicate::SLT, iv, hi, "go")?;
        self.b.build_conditional_branch(go, bb, exit)?;
        self.b.position_at_end(bb);
        body(self, iv)?;
        let latch = self.b.get_insert_block().ok_or_else(|| KernelError::Internal("no block".into()))?;
        let next = self.b.build_int_nsw_add(iv, lo.get_type().const_int(1, false), "next")?;
        self.b.build_unconditional_branch(head)?;
        i.add_incoming(&[(&next, latch)]);
        self.b.position_at_end(exit);
        Ok(())
    }

    /// An overloaded LLVM intrinsic on floats (`llvm.exp`, `llvm.maxnum`, ..).
    pub fn intrinsic(&self, name: &str, args: &[FloatValue<'ctx>]) -> R<FloatValue<'ctx>> {
        let ty = args.first().map(|a| a.get_type()).ok_or_else(|| KernelError::Internal(format!("{name} without operands")))?;
        let decl = Intrinsic::find(name)
            .and_then(|i| i.get_declaration(self.m, &[ty.into()]))
            .ok_or_else(|| KernelError::Internal(format!("no intrinsic {name}")))?;
        let args: Vec<BasicMetadataValueEnum> = args.iter().map(|&a| a.into()).collect();
        Ok(self.call(decl, &args, name)?.into_float_value())
    }

    /// a * b + c as `llvm.fmuladd`: one fused multiply-add where the CPU has one (rounded once),
    /// else a multiply and an add. The polynomials of exp and tanh are chains of these; fused,
    /// they are half the vector instructions, which the exp-bound row kernels (the
    /// cross-entropy's sum and gradient passes) are limited by.
    pub fn mul_add(&self, a: FloatValue<'ctx>, b: FloatValue<'ctx>, c: FloatValue<'ctx>) -> R<FloatValue<'ctx>> {
        self.intrinsic("llvm.fmuladd", &[a, b, c])
    }

    /// The value of a call to `f` (a function that returns one).
    pub fn call(&self, f: FunctionValue<'ctx>, args: &[BasicMetadataValueEnum<'ctx>], name: &str) -> R<BasicValueEnum<'ctx>> {
        match self.b.build_call(f, args, name)?.try_as_basic_value() {
            inkwell::values::ValueKind::Basic(v) => Ok(v),
            inkwell::values::ValueKind::Instruction(_) => Err(KernelError::Internal(format!("{}: {name} returned nothing", self.name))),
        }
    }

    /// A call of a libm function the JIT maps to its Rust implementation (`jit::EXTERNS`).
    pub fn libm(&self, name: &str, x: &[FloatValue<'ctx>]) -> R<FloatValue<'ctx>> {
        let ty = x.first().map(|a| a.get_type()).ok_or_else(|| KernelError::Internal(format!("{name} without operands")))?;
        let f = match self.m.get_function(name) {
            Some(f) => f,
            None => {
                let args: Vec<_> = x.iter().map(|_| ty.into()).collect();
                let f = self.m.add_function(name, ty.fn_type(&args, false), Some(Linkage::External));
                // pure functions of their arguments: LLVM may hoist a loop-invariant call (AdamW's
                // bias corrections, pow(beta, step), would otherwise be one call per element)
                for (attr, val) in [("nounwind", 0), ("willreturn", 0), ("nosync", 0), ("nofree", 0), ("speculatable", 0), ("memory", 0)] {
                    f.add_attribute(AttributeLoc::Function, self.cx.create_enum_attribute(Attribute::get_named_enum_kind_id(attr), val));
                }
                f
            }
        };
        let args: Vec<BasicMetadataValueEnum> = x.iter().map(|&a| a.into()).collect();
        Ok(self.call(f, &args, name)?.into_float_value())
    }

    pub fn is_nan(&self, x: FloatValue<'ctx>) -> R<IntValue<'ctx>> {
        Ok(self.b.build_float_compare(FloatPredicate::UNO, x, x, "nan")?)
    }
}
