use std::collections::HashMap;

use crate::error::IrError;
use crate::family::KernelFamily;
use crate::graph::{Graph, NodeId};
use crate::op::{BinaryOp, InputKind, Op, QuantParam, QuantScheme, QuantSpec, UnaryOp, BINARY_OPS, UNARY_OPS};
use crate::qmap::DynMap;
use crate::types::{DType, Shape, TensorType};

/// A cursor over one line. Errors are plain strings; `parse` adds the line number.
struct Cur<'a> {
    s: &'a str,
    pos: usize,
}

type R<T> = Result<T, String>;

impl<'a> Cur<'a> {
    fn rest(&self) -> &'a str {
        &self.s[self.pos..]
    }
    fn ws(&mut self) {
        let r = self.rest();
        self.pos += r.len() - r.trim_start().len();
    }
    fn eat(&mut self, tok: &str) -> bool {
        self.ws();
        if self.rest().starts_with(tok) {
            self.pos += tok.len();
            true
        } else {
            false
        }
    }
    fn expect(&mut self, tok: &str) -> R<()> {
        if self.eat(tok) {
            Ok(())
        } else {
            Err(format!("expected `{tok}` at `{}`", self.rest()))
        }
    }
    fn word(&mut self) -> R<&'a str> {
        self.ws();
        let r = self.rest();
        let n = r.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '.' || c == '-' || c == '+')).unwrap_or(r.len());
        if n == 0 {
            return Err(format!("expected a word at `{r}`"));
        }
        self.pos += n;
        Ok(&r[..n])
    }
    fn usize(&mut self) -> R<usize> {
        let w = self.word()?;
        w.parse().map_err(|_| format!("expected an integer, got `{w}`"))
    }
    fn node_ref(&mut self) -> R<usize> {
        self.expect("%")?;
        self.usize()
    }
    fn dims(&mut self) -> R<Vec<usize>> {
        self.expect("[")?;
        let mut d = Vec::new();
        if self.eat("]") {
            return Ok(d);
        }
        loop {
            d.push(self.usize()?);
            if self.eat("]") {
                return Ok(d);
            }
            self.expect(",")?;
        }
    }
    /// A string in Rust's `{:?}` escaping.
    fn string(&mut self) -> R<String> {
        self.expect("\"")?;
        let mut out = String::new();
        let mut chars = self.rest().char_indices();
        while let Some((i, c)) = chars.next() {
            match c {
                '"' => {
                    self.pos += i + 1;
                    return Ok(out);
                }
                '\\' => {
                    let (_, e) = chars.next().ok_or("unterminated escape")?;
                    match e {
                        'n' => out.push('\n'),
                        't' => out.push('\t'),
                        'r' => out.push('\r'),
                        '0' => out.push('\0'),
                        '\\' | '"' | '\'' => out.push(e),
                        'u' => {
                            let mut hex = String::new();
                            if chars.next().map(|x| x.1) != Some('{') {
                                return Err("bad \\u escape".into());
                            }
                            for (_, h) in chars.by_ref() {
                                if h == '}' {
                                    break;
                                }
                                hex.push(h);
                            }
                            let v = u32::from_str_radix(&hex, 16).map_err(|_| "bad \\u escape")?;
                            out.push(char::from_u32(v).ok_or("bad \\u escape")?);
                        }
                        _ => return Err(format!("unknown escape \\{e}")),
                    }
                }
                _ => out.push(c),
            }
        }
        Err("unterminated string".into())
    }
    fn ty(&mut self) -> R<TensorType> {
        let w = self.word_until('[')?;
        let dtype = DType::from_name(w).ok_or_else(|| format!("unknown dtype `{w}`"))?;
        Ok(TensorType::new(dtype, self.dims()?))
    }
    fn word_until(&mut self, stop: char) -> R<&'a str> {
        self.ws();
        let r = self.rest();
        let n = r.find(stop).ok_or_else(|| format!("expected `{stop}` in `{r}`"))?;
        self.pos += n;
        Ok(r[..n].trim())
    }
}

/// Attribute values as written; the op constructor interprets them.
struct Attrs(HashMap<String, String>);

impl Attrs {
    fn raw(&self, k: &str) -> R<&str> {
        self.0.get(k).map(|s| s.as_str()).ok_or_else(|| format!("missing attribute `{k}`"))
    }
    fn f(&self, k: &str) -> R<f64> {
        let v = self.raw(k)?;
        v.parse().map_err(|_| format!("attribute `{k}`: `{v}` is not a number"))
    }
    fn u(&self, k: &str) -> R<usize> {
        let v = self.raw(k)?;
        v.parse().map_err(|_| format!("attribute `{k}`: `{v}` is not an integer"))
    }
    fn b(&self, k: &str) -> R<bool> {
        match self.raw(k)? {
            "true" => Ok(true),
            "false" => Ok(false),
            v => Err(format!("attribute `{k}`: `{v}` is not a bool")),
        }
    }
    fn bits(&self) -> R<u8> {
        let b = self.u("bits")?;
        u8::try_from(b).map_err(|_| format!("bits {b} out of range"))
    }
    fn quant(&self) -> R<QuantSpec> {
        let s = self.raw("scheme")?;
        let scheme = QuantScheme::from_name(s).ok_or_else(|| format!("unknown quant scheme `{s}`"))?;
        Ok(QuantSpec { bits: self.bits()?, group: self.u("group")?, scheme })
    }
    fn dtype(&self, d: &str) -> R<DType> {
        DType::from_name(d).ok_or_else(|| format!("unknown dtype `{d}`"))
    }
    fn map(&self) -> R<DynMap> {
        let m = self.raw("map")?;
        DynMap::from_name(m).ok_or_else(|| format!("unknown quantization map `{m}`"))
    }
    fn reduce(&self) -> R<crate::collective::Reduce> {
        let r = self.raw("reduce")?;
        crate::collective::Reduce::from_name(r).ok_or_else(|| format!("unknown reduction `{r}` (sum, mean)"))
    }
    fn dims(&self, k: &str) -> R<Vec<usize>> {
        let v = self.raw(k)?;
        Cur { s: v, pos: 0 }.dims()
    }
}

fn make_op(mn: &str, a: &Attrs, ty: &TensorType) -> R<Op> {
    if let Some(u) = UNARY_OPS.iter().find(|u| Op::Unary(**u).mnemonic() == mn) {
        return Ok(Op::Unary(*u as UnaryOp));
    }
    if let Some(b) = BINARY_OPS.iter().find(|b| Op::Binary(**b).mnemonic() == mn) {
        return Ok(Op::Binary(*b as BinaryOp));
    }
    Ok(match mn {
        "input" => {
            let k = a.raw("kind")?;
            let kind = InputKind::from_name(k).ok_or_else(|| format!("unknown input kind `{k}`"))?;
            Op::Input { kind, dtype: ty.dtype, shape: ty.shape.clone() }
        }
        "const" => Op::Const { value: a.f("value")?, dtype: ty.dtype, shape: ty.shape.clone() },
        "affine" => Op::Affine { mul: a.f("mul")?, add: a.f("add")? },
        "cast" => Op::Cast { to: a.dtype(a.raw("to")?)? },
        "broadcast" => Op::Broadcast { shape: Shape(a.dims("shape")?) },
        "sum_to" => Op::SumTo { shape: Shape(a.dims("shape")?) },
        "reshape" => Op::Reshape { shape: Shape(a.dims("shape")?) },
        "transpose" => Op::Transpose { perm: a.dims("perm")? },
        "slice" => Op::Slice { axis: a.u("axis")?, start: a.u("start")?, end: a.u("end")? },
        "concat" => Op::Concat { axis: a.u("axis")? },
        "matmul" => Op::MatMul { ta: a.b("ta")?, tb: a.b("tb")? },
        "gather" => Op::Gather,
        "scatter_add" => Op::ScatterAdd { rows: a.u("rows")? },
        "layernorm" => Op::LayerNorm { eps: a.f("eps")? },
        "layernorm_grad_x" => Op::LayerNormGradX { eps: a.f("eps")? },
        "layernorm_grad_gamma" => Op::LayerNormGradGamma { eps: a.f("eps")? },
        "softmax" => Op::Softmax { scale: a.f("scale")?, causal: a.b("causal")? },
        "softmax_grad" => Op::SoftmaxGrad { scale: a.f("scale")? },
        "packed_softmax" => Op::PackedSoftmax { scale: a.f("scale")? },
        "cross_entropy" => Op::CrossEntropy,
        "cross_entropy_grad" => Op::CrossEntropyGrad,
        "weighted_cross_entropy" => Op::WeightedCrossEntropy,
        "weighted_cross_entropy_grad" => Op::WeightedCrossEntropyGrad,
        "fake_quant" => Op::FakeQuant { spec: a.quant()? },
        "dequantize" => Op::Dequantize { spec: a.quant()?, to: a.0.get("to").map_or(Ok(DType::F32), |d| a.dtype(d))? },
        "fake_quant_learned" => Op::FakeQuantLearned { spec: a.quant()? },
        "fake_quant_learned_grad" => {
            let w = a.raw("wrt")?;
            let wrt = QuantParam::from_name(w).ok_or_else(|| format!("unknown wrt `{w}` (weight, scale, zero)"))?;
            Op::FakeQuantLearnedGrad { spec: a.quant()?, wrt }
        }
        "act_quant" => Op::ActQuant { bits: a.bits()? },
        "dropout" => Op::Dropout { p: a.f("p")?, stream: a.u("stream")? },
        "all_finite" => Op::AllFinite,
        "select" => Op::Select,
        "loss_scale" => Op::LossScale { interval: a.u("interval")?, growth: a.f("growth")?, backoff: a.f("backoff")? },
        // the body is parsed from the lines that follow and put in place by `parse`
        "kernel" => {
            let family: KernelFamily = a.raw("family")?.parse().map_err(|e: crate::family::UnknownFamily| e.to_string())?;
            Op::Kernel { body: Box::new(Graph::new(family.to_string())), family }
        }
        "adam_m" => Op::AdamM { beta1: a.f("beta1")? },
        "adam_v" => Op::AdamV { beta2: a.f("beta2")? },
        "adam_param" => Op::AdamParam { beta1: a.f("beta1")?, beta2: a.f("beta2")?, eps: a.f("eps")?, weight_decay: a.f("weight_decay")? },
        "block_dequant" => Op::BlockDequant { map: a.map()? },
        "block_absmax" => Op::BlockAbsMax,
        "block_quant" => Op::BlockQuant { map: a.map()? },
        "all_reduce" => Op::AllReduce { reduce: a.reduce()?, world: a.u("world")? },
        "reduce_scatter" => Op::ReduceScatter { reduce: a.reduce()?, world: a.u("world")? },
        "all_gather" => Op::AllGather { world: a.u("world")? },
        _ => return Err(format!("unknown op `{mn}`")),
    })
}

enum Line {
    Node { num: usize, op: Op, operands: Vec<usize>, ty: TensorType, name: Option<String>, body: bool },
    Output { update: bool, name: String, num: usize },
}

fn parse_line(c: &mut Cur) -> R<Line> {
    if c.eat("output") {
        let name = c.string()?;
        c.expect("=")?;
        return Ok(Line::Output { update: false, name, num: c.node_ref()? });
    }
    if c.eat("update") {
        let name = c.string()?;
        c.expect("=")?;
        return Ok(Line::Output { update: true, name, num: c.node_ref()? });
    }
    let num = c.node_ref()?;
    c.expect("=")?;
    c.ws();
    let r = c.rest();
    let n = r.find(|ch: char| !(ch.is_ascii_alphanumeric() || ch == '_')).unwrap_or(r.len());
    let mn = &r[..n];
    c.pos += n;
    let mut attrs = HashMap::new();
    if c.eat("[") {
        loop {
            let k = c.word_until('=')?.to_string();
            c.expect("=")?;
            c.ws();
            let v = if c.rest().starts_with('[') {
                let start = c.pos;
                c.dims()?;
                c.s[start..c.pos].to_string()
            } else if c.rest().starts_with('"') {
                c.string()?
            } else {
                c.word()?.to_string()
            };
            attrs.insert(k, v);
            if c.eat("]") {
                break;
            }
            c.expect(",")?;
        }
    }
    let mut operands = Vec::new();
    if c.eat("(") && !c.eat(")") {
        loop {
            operands.push(c.node_ref()?);
            if c.eat(")") {
                break;
            }
            c.expect(",")?;
        }
    }
    c.expect(":")?;
    let ty = c.ty()?;
    c.ws();
    let name = if c.rest().starts_with('"') { Some(c.string()?) } else { None };
    let body = c.eat("{");
    c.ws();
    if !c.rest().is_empty() {
        return Err(format!("unexpected `{}`", c.rest()));
    }
    let keys: Vec<String> = attrs.keys().cloned().collect();
    let op = make_op(mn, &Attrs(attrs), &ty)?;
    let known = op.attrs();
    if let Some(k) = keys.iter().find(|k| !known.iter().any(|(n, _)| n == k)) {
        return Err(format!("`{mn}` has no attribute `{k}`"));
    }
    Ok(Line::Node { num, op, operands, ty, name, body })
}

/// Parses the text format. Types written after `:` must equal what the ops infer; node numbers
/// must be defined before use (the printer's topological numbering guarantees it).
pub fn parse(text: &str) -> Result<Graph, IrError> {
    let lines: Vec<(usize, &str)> =
        text.lines().enumerate().map(|(i, l)| (i + 1, l.trim())).filter(|(_, l)| !l.is_empty() && !l.starts_with("//")).collect();
    let err = |line: usize, msg: String| IrError::Parse { line, msg };
    let (hl, header) = *lines.first().ok_or_else(|| err(1, "empty input".into()))?;
    let mut c = Cur { s: header, pos: 0 };
    c.expect("graph").map_err(|m| err(hl, m))?;
    let name = c.string().map_err(|m| err(hl, m))?;
    c.expect("{").map_err(|m| err(hl, m))?;
    let mut pos = 1;
    let g = parse_body(&lines, &mut pos, name)?;
    if let Some((ln, _)) = lines.get(pos) {
        return Err(err(*ln, "text after the closing `}`".into()));
    }
    Ok(g)
}

/// Parses nodes and outputs from `lines[*pos..]` up to and including the closing `}`.
fn parse_body(lines: &[(usize, &str)], pos: &mut usize, name: String) -> Result<Graph, IrError> {
    let err = |line: usize, msg: String| IrError::Parse { line, msg };
    let mut g = Graph::new(name);
    let mut ids: HashMap<usize, NodeId> = HashMap::new();
    while let Some(&(ln, line)) = lines.get(*pos) {
        *pos += 1;
        if line == "}" {
            return Ok(g);
        }
        let parsed = parse_line(&mut Cur { s: line, pos: 0 }).map_err(|m| err(ln, m))?;
        let lookup = |n: usize| ids.get(&n).copied().ok_or_else(|| err(ln, format!("%{n} is used before it is defined")));
        match parsed {
            Line::Node { num, mut op, operands, ty, name, body } => {
                let ops = operands.into_iter().map(lookup).collect::<Result<Vec<_>, _>>()?;
                match (&mut op, body) {
                    (Op::Kernel { family, body }, true) => **body = parse_body(lines, pos, family.to_string())?,
                    (Op::Kernel { .. }, false) => return Err(err(ln, "a kernel needs a body: `{` ... `}`".into())),
                    (_, true) => return Err(err(ln, "only kernels have a body".into())),
                    _ => {}
                }
                let id = g.add_node(op, &ops, name).map_err(|e| err(ln, e.to_string()))?;
                if *g.ty(id) != ty {
                    return Err(err(ln, format!("written type {ty} but the op computes {}", g.ty(id))));
                }
                if ids.insert(num, id).is_some() {
                    return Err(err(ln, format!("%{num} is defined twice")));
                }
            }
            Line::Output { update, name, num } => {
                let id = lookup(num)?;
                let r = if update { g.set_update(name, id) } else { g.set_output(name, id) };
                r.map_err(|e| err(ln, e.to_string()))?;
            }
        }
    }
    Err(err(lines.last().map(|l| l.0).unwrap_or(1), "missing closing `}`".into()))
}
