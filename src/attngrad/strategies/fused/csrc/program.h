// Score programs: a FlexAttention score_mod(score, b, h, q_idx, kv_idx), traced in Python
// (`attngrad.core.score_program`) into a straight-line program of vector ops, which the
// kernels run here on each row of a tile while it is in cache: forward S' = score_mod(S),
// backward dS from dS' (the backward program, derived in Python by reverse mode).  A
// BlockMask's mask_mod(b, h, q_idx, kv_idx) is a third role, a mask program: no SCORE, GRAD
// or SCATTER, its out an I register (nonzero = the score is kept), run on the segments of a
// row that lie in the mask's partial blocks (`tile.h`, `mask_blocks`).  This file only
// evaluates programs; it never derives one.
//
// Encoding -- a program is three tensors and one int:
//   code       int64 [n, 6], one instruction per row: (op, dst, a, b, c, uniform).  op: the
//              opcode, numbered by the order of ATTNGRAD_PROGRAM_OPS below (Python reads the
//              names in that order from the op `program_ops()`: this table is the one source
//              of truth).  dst, a, b, c: register numbers (-1 where unused) or, for GATHER and
//              SCATTER, other integers.  uniform (0/1): the value is the same in every column
//              of a row (it depends on b, h, q_idx, constants and captures read at such
//              indices only); the interpreter then evaluates lane 0 alone.  Binary ops
//              take such an operand as a scalar; where another op reads it per column
//              (a gather's index, WHERE, a cast, SCATTER's value, out), it is broadcast
//              over the row once.  A pure optimisation: a program evaluated with every
//              flag 0 gives the same bits.
//   constants  float64 [n]: instruction k's immediate (CONST_F / CONST_I), else unused.
//   indices    int64 [m]: the index registers of GATHER / SCATTER, a list per instruction.
//   out        the register holding the result (forward: S'; backward: dS; both F), or a
//              mask program's verdict (I).
//
// Registers 0 .. R - 1 (R = the largest dst + 1) each hold one row of the tile, c values
// (the tile row's columns), of one kind fixed by the op that writes it: F, the compute
// dtype T (float or double), or I, int64 (indices, integers, and bools as 0/1).  Each
// register is written once (SSA), before it is read.
//
// Loads: SCORE (F) the row's raw scores S = scale q k^T after the softcap, what score_mod
//   receives; GRAD (F, backward programs only) dS' = the gradient w.r.t. the modified scores
//   S', the row of dS the kernel formed (P * (dP - Delta), dropout as without a program);
//   BATCH (I) b mod `batch`; HEAD h (the query head); QUERY q_idx = i; KEY kv_idx = j, per
//   column; CONST_F / CONST_I constants[k] (CONST_I truncated to int64, exact below 2^53).
// GATHER_F (F) / GATHER_I (I): dst = captured[a][idx_0, .., idx_{r-1}], r = c, the index
//   registers indices[b .. b + r) (b an offset, not a register; I registers, per column).
//   A negative index counts from the end once (torch's wrap); one still outside [0, size)
//   is out of bounds: the value is 0 and the position is remembered (below).  captured[a]
//   is dtype T for GATHER_F, int64 for GATHER_I; r = its dim (0-d captures: r = 0).
// SCATTER (backward programs only): dcaptured[a][idx..] += reg[dst] per column -- dst is the
//   F register read (nothing is written), a, b, c as for GATHER.  When every index register
//   is uniform, the row is summed first (a fixed vector order, below) and added once.
// Elementwise: F, F -> F ADD_F SUB_F MUL_F DIV_F MIN_F MAX_F (NaN propagates, as torch's
//   minimum / maximum) FLOORDIV_F REMAINDER_F (both torch's, bit for bit: floor_divide's
//   fmod-based quotient, remainder with the divisor's sign); F -> F NEG_F ABS_F EXP_F LOG_F
//   TANH_F SIGMOID_F SQRT_F FLOOR_F; F, F -> I LT_F LE_F GT_F GE_F EQ_F NE_F (0/1);
//   I, I -> I ADD_I SUB_I MUL_I MIN_I MAX_I AND_I OR_I XOR_I FLOORDIV_I REMAINDER_I
//   LT_I LE_I GT_I GE_I EQ_I NE_I; I -> I NEG_I ABS_I NOT_I (bitwise ~); WHERE_F (a an I
//   condition, nonzero = true; b, c F), WHERE_I (b, c I); TO_F (I -> F, rounded to nearest),
//   TO_I (F -> I, truncated toward zero as torch's .long()).
//
// Choices where torch leaves the result open or raises:
// * TO_I of NaN or of a value outside int64's range gives 0 (torch: unspecified).
// * Integer ops wrap around on overflow (two's complement, as torch's CPU kernels do in
//   practice); FLOORDIV_I(INT64_MIN, -1) = INT64_MIN, REMAINDER_I(INT64_MIN, -1) = 0.
// * FLOORDIV_I / REMAINDER_I by 0 raise RuntimeError "ZeroDivisionError" (as torch), at any
//   position, masked or not.
// * Out of bounds: `program_rows` raises IndexError on any; the kernels raise it where the
//   position is kept by the call's mask (its keep mask and band, and a BlockMask's blocks
//   with its mask program's verdict), and let masked positions read (0) or write (skipped)
//   out of bounds -- as torch's compiled kernel never evaluates the function where a
//   BlockMask masks the score.  A SCATTER out of bounds is reported like a GATHER.  A mask
//   program runs on partial blocks alone, where torch evaluates mask_mod too: any read out
//   of bounds there raises.
// * A uniform SCATTER sums the row's values in a fixed order -- four vector accumulators
//   over the columns, then ATen's lane reduction -- a function of c and the vector width,
//   so the same for any thread count (not across AVX2 and AVX-512 builds).
// * Checks when a program is made (ValueError / TypeError): a register read before it is
//   written, written twice, or of the wrong kind; a uniform instruction that reads a
//   register not marked uniform; SCORE, GRAD or KEY marked uniform; GRAD or SCATTER in a
//   forward program, SCORE in a mask program; an out of the wrong kind; a capture's rank or
//   dtype that does not fit its op.
//
// Evaluation: F ops through at::vec::Vectorized<T> (exp, log: Sleef through its methods;
// tanh: `tanh_vec`), so a uniform row's lane 0 and a full row give the same bits; I ops and the
// casts as plain loops the compiler vectorises.  Scratch per thread: one row of ld values
// per register that needs one (SCORE and GRAD alias the rows they load); CONST_F, CONST_I
// and KEY rows are kept from one row to the next while they hold (the same key block).
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "elementary.h"

namespace attngrad_fused {

// OP(name, kind of the result, kinds of a, b, c).  Kinds: F, I (a register of that kind),
// N (unused), X (an integer that is no register: GATHER / SCATTER's capture, offset, rank).
#define ATTNGRAD_PROGRAM_OPS(OP) \
  OP(SCORE, F, N, N, N)          \
  OP(GRAD, F, N, N, N)           \
  OP(BATCH, I, N, N, N)          \
  OP(HEAD, I, N, N, N)           \
  OP(QUERY, I, N, N, N)          \
  OP(KEY, I, N, N, N)            \
  OP(CONST_F, F, N, N, N)        \
  OP(CONST_I, I, N, N, N)        \
  OP(GATHER_F, F, X, X, X)       \
  OP(GATHER_I, I, X, X, X)       \
  OP(SCATTER, N, X, X, X)        \
  OP(ADD_F, F, F, F, N)          \
  OP(SUB_F, F, F, F, N)          \
  OP(MUL_F, F, F, F, N)          \
  OP(DIV_F, F, F, F, N)          \
  OP(MIN_F, F, F, F, N)          \
  OP(MAX_F, F, F, F, N)          \
  OP(FLOORDIV_F, F, F, F, N)     \
  OP(REMAINDER_F, F, F, F, N)    \
  OP(NEG_F, F, F, N, N)          \
  OP(ABS_F, F, F, N, N)          \
  OP(EXP_F, F, F, N, N)          \
  OP(LOG_F, F, F, N, N)          \
  OP(TANH_F, F, F, N, N)         \
  OP(SIGMOID_F, F, F, N, N)      \
  OP(SQRT_F, F, F, N, N)         \
  OP(FLOOR_F, F, F, N, N)        \
  OP(LT_F, I, F, F, N)           \
  OP(LE_F, I, F, F, N)           \
  OP(GT_F, I, F, F, N)           \
  OP(GE_F, I, F, F, N)           \
  OP(EQ_F, I, F, F, N)           \
  OP(NE_F, I, F, F, N)           \
  OP(ADD_I, I, I, I, N)          \
  OP(SUB_I, I, I, I, N)          \
  OP(MUL_I, I, I, I, N)          \
  OP(MIN_I, I, I, I, N)          \
  OP(MAX_I, I, I, I, N)          \
  OP(AND_I, I, I, I, N)          \
  OP(OR_I, I, I, I, N)           \
  OP(XOR_I, I, I, I, N)          \
  OP(FLOORDIV_I, I, I, I, N)     \
  OP(REMAINDER_I, I, I, I, N)    \
  OP(NEG_I, I, I, N, N)          \
  OP(ABS_I, I, I, N, N)          \
  OP(NOT_I, I, I, N, N)          \
  OP(LT_I, I, I, I, N)           \
  OP(LE_I, I, I, I, N)           \
  OP(GT_I, I, I, I, N)           \
  OP(GE_I, I, I, I, N)           \
  OP(EQ_I, I, I, I, N)           \
  OP(NE_I, I, I, I, N)           \
  OP(WHERE_F, F, I, F, F)        \
  OP(WHERE_I, I, I, I, I)        \
  OP(TO_F, F, I, N, N)           \
  OP(TO_I, I, F, N, N)

enum class Op : int64_t {
#define ATTNGRAD_OP_ENUM(name, r, a, b, c) name,
  ATTNGRAD_PROGRAM_OPS(ATTNGRAD_OP_ENUM)
#undef ATTNGRAD_OP_ENUM
      kCount
};

enum class Kind : int8_t { N, F, I, X };

struct OpInfo {
  const char* name;
  Kind result, a, b, c;
};

inline const OpInfo& op_info(Op op) {
  static const OpInfo table[] = {
#define ATTNGRAD_OP_INFO(name, r, a, b, c) {#name, Kind::r, Kind::a, Kind::b, Kind::c},
      ATTNGRAD_PROGRAM_OPS(ATTNGRAD_OP_INFO)
#undef ATTNGRAD_OP_INFO
  };
  return table[static_cast<int64_t>(op)];
}

// Binary ops (F, F or I, I; comparisons too): they take a uniform operand as a scalar.
inline bool broadcasts(const OpInfo& info) {
  return (info.a == Kind::F || info.a == Kind::I) && info.b == info.a && info.c == Kind::N;
}

// The op names in enum order: what `program_ops()` returns.
inline std::vector<std::string> program_op_names() {
  std::vector<std::string> names;
  for (int64_t k = 0; k < static_cast<int64_t>(Op::kCount); ++k)
    names.emplace_back(op_info(static_cast<Op>(k)).name);
  return names;
}

struct Instr {
  Op op;
  int64_t dst, a, b, c;
  bool uniform;
  double constant;           // CONST_F's immediate
  int64_t integer = 0;       // CONST_I's
  bool one_position = false; // SCATTER whose index registers are all uniform
};

struct Capture {
  at::Tensor t;  // contiguous, kept alive while the program runs
  std::vector<int64_t> sizes, strides;
  int64_t numel;
};

// A checked program: its instructions, and per register its kind, whether it is uniform,
// whether it must be broadcast over the row, and its row in its kind's scratch (-1: SCORE
// and GRAD, which alias the rows they load).
struct Program {
  const char* function = "score_mod";  // what the user wrote, as messages name it
  std::vector<Instr> code;
  std::vector<int64_t> indices;
  std::vector<Capture> captured;
  int64_t out = -1, batch = 1;
  // The instruction that writes `out` may write the caller's row (`Runner::run`'s dest)
  // in place of its register (direct_out); where dest is the SCORE or GRAD row, only when
  // no later instruction reads those (last_load_read: the last instruction that does).
  bool direct_out = false;
  int64_t out_instr = -1, last_load_read = -1;
  std::vector<Kind> kind;
  std::vector<uint8_t> uniform, expand;
  std::vector<int64_t> slot;
  int64_t f_slots = 0, i_slots = 0;
};

// NaN and values outside int64's range -> 0; else truncation toward zero.
template <typename T>
inline int64_t to_int(T x) {
  constexpr double lim = 9223372036854775808.0;  // 2^63
  const double v = static_cast<double>(x);
  return v >= -lim && v < lim ? static_cast<int64_t>(v) : 0;
}

// What a program computes: a score_mod's S' (forward) or dS (backward: GRAD and SCATTER
// allowed), or a mask_mod's verdict (mask: no SCORE, an I out).
enum class Role { kForward, kBackward, kMask };

// `code` etc. as the ops receive them, checked (`which` names the program in errors);
// `dtype`: the compute dtype T.
inline Program make_program(const char* which, const at::Tensor& code,
                            const std::optional<at::Tensor>& constants,
                            const std::optional<at::Tensor>& indices, int64_t out,
                            at::TensorList captured, int64_t batch, at::ScalarType dtype,
                            Role role) {
  const bool backward = role == Role::kBackward, mask = role == Role::kMask;
  TORCH_CHECK_TYPE(code.scalar_type() == at::kLong, "attngrad_fused: ", which,
                   " code must be int64, got ", code.scalar_type());
  TORCH_CHECK_VALUE(code.dim() == 2 && code.size(1) == 6, "attngrad_fused: ", which,
                    " code must be [n, 6] (op, dst, a, b, c, uniform), got shape ", code.sizes());
  const int64_t n = code.size(0);
  TORCH_CHECK_VALUE(constants.has_value() || n == 0, "attngrad_fused: ", which,
                    " constants must be given with code");
  if (constants) {
    TORCH_CHECK_TYPE(constants->scalar_type() == at::kDouble, "attngrad_fused: ", which,
                     " constants must be float64, got ", constants->scalar_type());
    TORCH_CHECK_VALUE(constants->numel() == n, "attngrad_fused: ", which, " constants must have ",
                      "one value per instruction (", n, "), got shape ", constants->sizes());
  }
  if (indices)
    TORCH_CHECK_TYPE(indices->scalar_type() == at::kLong, "attngrad_fused: ", which,
                     " indices must be int64, got ", indices->scalar_type());
  TORCH_CHECK_VALUE(batch >= 1, "attngrad_fused: batch must be >= 1, got ", batch);
  Program pg;
  pg.function = mask ? "mask_mod" : "score_mod";
  pg.batch = batch;
  pg.out = out;
  if (indices) {
    const at::Tensor ix = indices->contiguous().to(at::kCPU);
    pg.indices.assign(ix.data_ptr<int64_t>(), ix.data_ptr<int64_t>() + ix.numel());
  }
  for (const at::Tensor& t : captured) {
    TORCH_CHECK_VALUE(t.device().is_cpu(), "attngrad_fused: captured tensors must be on the ",
                      "CPU, got one on ", t.device());
    Capture cap;
    cap.t = t.contiguous();
    cap.sizes = cap.t.sizes().vec();
    cap.strides = cap.t.strides().vec();
    cap.numel = cap.t.numel();
    pg.captured.push_back(std::move(cap));
  }
  const at::Tensor cc = code.contiguous().to(at::kCPU);
  const int64_t* rows = cc.data_ptr<int64_t>();
  const at::Tensor kc = constants ? constants->contiguous().to(at::kCPU) : at::Tensor();
  int64_t regs = 0;
  for (int64_t k = 0; k < n; ++k) {
    const int64_t op = rows[6 * k];
    TORCH_CHECK_VALUE(op >= 0 && op < static_cast<int64_t>(Op::kCount), "attngrad_fused: ",
                      which, " instruction ", k, " has opcode ", op, ", not one of program_ops()");
    if (op_info(static_cast<Op>(op)).result != Kind::N) regs = std::max(regs, rows[6 * k + 1] + 1);
  }
  pg.kind.assign(regs, Kind::N);
  pg.uniform.assign(regs, 0);
  pg.expand.assign(regs, 0);
  pg.slot.assign(regs, -1);
  auto where = [&](int64_t k) {
    std::ostringstream s;
    s << "attngrad_fused: " << which << " instruction " << k << " ("
      << op_info(static_cast<Op>(rows[6 * k])).name << ")";
    return s.str();
  };
  // A register read by instruction k, of `want` kind; `per_column`: read in every column.
  auto read = [&](int64_t k, int64_t reg, Kind want, bool uniform, bool per_column) {
    TORCH_CHECK_VALUE(reg >= 0 && reg < regs && pg.kind[reg] != Kind::N, where(k),
                      " reads register ", reg, " before any instruction writes it");
    TORCH_CHECK_VALUE(pg.kind[reg] == want, where(k), " reads register ", reg, " as ",
                      want == Kind::F ? "F" : "I", ", but it holds ",
                      pg.kind[reg] == Kind::F ? "F" : "I");
    TORCH_CHECK_VALUE(!uniform || pg.uniform[reg], where(k), " is marked uniform but reads ",
                      "register ", reg, ", which is not");
    if (per_column && pg.uniform[reg]) pg.expand[reg] = 1;
  };
  for (int64_t k = 0; k < n; ++k) {
    const int64_t* row = rows + 6 * k;
    Instr in{static_cast<Op>(row[0]), row[1], row[2], row[3], row[4], row[5] != 0,
             constants ? kc.data_ptr<double>()[k] : 0.0};
    const OpInfo& info = op_info(in.op);
    if (in.op == Op::CONST_I) in.integer = to_int(in.constant);
    TORCH_CHECK_VALUE(backward || (in.op != Op::GRAD && in.op != Op::SCATTER), where(k),
                      ": GRAD and SCATTER belong to backward programs");
    TORCH_CHECK_VALUE(!mask || in.op != Op::SCORE, where(k), ": a mask program has no score");
    const bool per_row = in.op == Op::SCORE || in.op == Op::GRAD || in.op == Op::KEY;
    TORCH_CHECK_VALUE(!(in.uniform && per_row), where(k), " cannot be uniform");
    if (in.op == Op::SCATTER) in.uniform = false;  // its value is read per column
    const int64_t ops[3] = {in.a, in.b, in.c};
    const Kind kinds[3] = {info.a, info.b, info.c};
    if (info.a == Kind::X) {  // GATHER_F, GATHER_I, SCATTER: capture a, indices[b .. b + c)
      TORCH_CHECK_VALUE(in.a >= 0 && in.a < static_cast<int64_t>(pg.captured.size()), where(k),
                        " reads captured tensor ", in.a, " of ", pg.captured.size());
      const Capture& cap = pg.captured[in.a];
      TORCH_CHECK_VALUE(in.c == static_cast<int64_t>(cap.sizes.size()), where(k), " indexes ",
                        "captured tensor ", in.a, " of shape ", cap.t.sizes(), " with ", in.c,
                        " indices");
      TORCH_CHECK_VALUE(in.b >= 0 && in.b + in.c <= static_cast<int64_t>(pg.indices.size()),
                        where(k), " takes indices[", in.b, " .. ", in.b + in.c, ") of ",
                        pg.indices.size());
      const at::ScalarType want = in.op == Op::GATHER_I ? at::kLong : dtype;
      TORCH_CHECK_TYPE(cap.t.scalar_type() == want, where(k), " needs captured tensor ", in.a,
                       " in ", want, ", got ", cap.t.scalar_type());
      bool all_uniform = true;
      for (int64_t x = 0; x < in.c; ++x) {
        const int64_t reg = pg.indices[in.b + x];
        TORCH_CHECK_VALUE(reg >= 0 && reg < regs, where(k), " reads index register ", reg,
                          " before any instruction writes it");
        all_uniform = all_uniform && pg.uniform[reg];
      }
      in.one_position = in.op == Op::SCATTER && all_uniform;
      for (int64_t x = 0; x < in.c; ++x)
        read(k, pg.indices[in.b + x], Kind::I, in.uniform, !in.uniform && !in.one_position);
      if (in.op == Op::SCATTER) read(k, in.dst, Kind::F, false, true);
    } else {
      // a binary op reads a uniform operand's lane 0 itself: no broadcast over the row
      const bool per_column = !in.uniform && !broadcasts(info);
      for (int x = 0; x < 3; ++x)
        if (kinds[x] != Kind::N) read(k, ops[x], kinds[x], in.uniform, per_column);
    }
    if (info.result != Kind::N) {
      TORCH_CHECK_VALUE(in.dst >= 0 && pg.kind[in.dst] == Kind::N, where(k), " writes register ",
                        in.dst, in.dst < 0 ? "" : ", which an earlier instruction wrote");
      pg.kind[in.dst] = info.result;
      pg.uniform[in.dst] = in.uniform;
    }
    pg.code.push_back(in);
  }
  const Kind out_kind = mask ? Kind::I : Kind::F;
  TORCH_CHECK_VALUE(out >= 0 && out < regs && pg.kind[out] == out_kind, "attngrad_fused: ", which,
                    " out = ", out, " must be an ", mask ? "I" : "F",
                    " register that the program writes");
  if (pg.uniform[out]) pg.expand[out] = 1;  // the result is a row
  for (int64_t k = 0; k < n; ++k) {
    const Instr& in = pg.code[k];
    if (op_info(in.op).result != Kind::N && in.dst == out) pg.out_instr = k;
    auto loads = [&](int64_t reg) {
      if (reg < 0 || reg >= regs || pg.kind[reg] == Kind::N) return false;
      for (const Instr& w : pg.code)
        if ((w.op == Op::SCORE || w.op == Op::GRAD) && w.dst == reg) return true;
      return false;
    };
    bool reads = in.op == Op::SCATTER && loads(in.dst);
    const OpInfo& info = op_info(in.op);
    if (info.a != Kind::X)
      reads = reads || (info.a != Kind::N && loads(in.a)) || (info.b != Kind::N && loads(in.b)) ||
              (info.c != Kind::N && loads(in.c));
    if (reads) pg.last_load_read = k;
  }
  const Op writer = pg.code[pg.out_instr].op;
  // not SCORE / GRAD (aliases), nor the rows kept from one row to the next; a mask's verdict
  // is read from its register
  pg.direct_out = !mask && !pg.uniform[out] && writer != Op::SCORE && writer != Op::GRAD &&
                  writer != Op::CONST_F && writer != Op::KEY;
  for (const Instr& in : pg.code) {
    if (in.op == Op::SCORE || in.op == Op::GRAD || op_info(in.op).result == Kind::N) continue;
    pg.slot[in.dst] = pg.kind[in.dst] == Kind::F ? pg.f_slots++ : pg.i_slots++;
  }
  return pg;
}

// Integer arithmetic that wraps around (two's complement) instead of overflowing.
inline int64_t wrap(uint64_t x) { return static_cast<int64_t>(x); }
inline uint64_t bits(int64_t x) { return static_cast<uint64_t>(x); }

// torch's floor_divide and remainder of int64 (b != 0, checked by the caller).
inline int64_t floordiv_int(int64_t a, int64_t b) {
  if (b == -1) return wrap(0 - bits(a));  // INT64_MIN / -1 would trap
  const int64_t quot = a / b, rem = a % b;
  return rem != 0 && ((a < 0) != (b < 0)) ? quot - 1 : quot;
}
inline int64_t remainder_int(int64_t a, int64_t b) {
  if (b == -1) return 0;
  int64_t r = a % b;
  return r != 0 && ((r < 0) != (b < 0)) ? r + b : r;
}

// An int64 of magnitude below 2^51 as a double, and a double's nearest int64 (below 2^51),
// in forms compilers vectorise (AVX2 has no int64 <-> double instruction): the bits of
// 1.5 * 2^52 + x are those of 1.5 * 2^52 plus x, exactly.
constexpr uint64_t kMagicBits = 0x4338000000000000ull;
constexpr double kMagic = 6755399441055744.0;  // 1.5 * 2^52
inline double small_to_double(int64_t x) {
  const uint64_t u = bits(x) + kMagicBits;
  double v;
  std::memcpy(&v, &u, sizeof v);
  return v - kMagic;
}
inline int64_t nearest_int(double v) {
  const double w = v + kMagic;
  uint64_t u;
  std::memcpy(&u, &w, sizeof u);
  return wrap(u - kMagicBits);
}

// torch's floor division (or remainder) of x[0 .. n) by a uniform divisor y, through doubles
// where that is exact: 0 < |y| < 2^31 and every |x| < 2^31 (indices, positions, block
// numbers: `kv_idx % 3`, `kv_idx // page`).  q, the integer nearest x * (1 / y), is within
// one of floor(x / y) (|x / y| < 2^31, the product's error below 2^-21); the remainder
// x - q y is exact in doubles (every term below 2^32), and one step by y either way puts it
// in torch's range (the divisor's sign).  The comparisons are integer ones, so the loop has
// no branch and compilers vectorise it: a few cycles a column, where an int64 division
// takes tens.  Returns false, writing nothing, where a value is outside that range.
template <bool kRemainder>
inline bool divide_uniform(const int64_t* x, int64_t y, int64_t n, int64_t* d) {
  constexpr int64_t lim = int64_t(1) << 31;
  if (y == 0 || y <= -lim || y >= lim) return false;
  uint64_t outside = 0;  // bits at 2^32 and up of x + 2^31: some |x| >= 2^31
  for (int64_t j = 0; j < n; ++j) outside |= (bits(x[j]) + bits(lim)) & ~(2 * bits(lim) - 1);
  if (outside != 0) return false;
  const double yd = static_cast<double>(y), inv = 1.0 / yd;
  const int64_t negative = y >> 63, size = (y ^ negative) - negative;  // all ones where y < 0; |y|
  for (int64_t j = 0; j < n; ++j) {
    const double xd = small_to_double(x[j]);
    const double qd = (xd * inv + kMagic) - kMagic;  // the nearest integer
    int64_t q = nearest_int(qd);
    int64_t r = nearest_int(xd - qd * yd);
    const int64_t rs = (r ^ negative) - negative;  // r * sign(y): torch's range 0 <= rs < |y|
    const int64_t up = rs >= size, down = rs < 0;
    q += up - down;
    r += (down ? y : 0) - (up ? y : 0);
    d[j] = kRemainder ? r : q;
  }
  return true;
}

// torch's floor_divide of floating vectors (ATen's div_floor_floating_vec): the quotient
// from fmod, rounded to the nearest integer of floor((a - fmod(a, b)) / b).
template <typename T>
inline at::vec::Vectorized<T> floordiv_vec(const at::vec::Vectorized<T>& a,
                                           const at::vec::Vectorized<T>& b) {
  using Vec = at::vec::Vectorized<T>;
  const Vec zero(T(0)), one(T(1)), half(T(0.5)), inf(std::numeric_limits<T>::infinity());
  const Vec basic = a / b;
  const Vec mod = a.fmod(b);
  // where a / b overflows but a is finite, Sleef's fmod is no help: take a itself
  const Vec floor = Vec::blendv(a - mod, a, (basic.abs() == inf) & (a.abs() != inf));
  Vec div = floor / b;
  div = Vec::blendv(div, div - one, (mod != zero) & ((b < zero) ^ (mod < zero)));
  Vec q = div.floor();
  q = Vec::blendv(q, q + one, (div - q) > half);
  q = Vec::blendv(q, zero.copysign(basic), div == zero);
  return Vec::blendv(q, basic, b == zero);
}

// torch's remainder of floating vectors: fmod, moved by b where its sign is not b's.
template <typename T>
inline at::vec::Vectorized<T> remainder_vec(const at::vec::Vectorized<T>& a,
                                            const at::vec::Vectorized<T>& b) {
  using Vec = at::vec::Vectorized<T>;
  const Vec zero(T(0));
  const Vec mod = a.fmod(b);
  return Vec::blendv(mod, mod + b, (mod != zero) & ((b < zero) ^ (mod < zero)));
}

// The sum of x[0 .. c): four vector chains, then the lanes (a fixed order for a given c).
template <typename T>
inline T row_sum(const T* x, int64_t c) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  Vec s0(T(0)), s1(T(0)), s2(T(0)), s3(T(0));
  int64_t j = 0;
  for (; j + 4 * W <= c; j += 4 * W) {
    s0 = s0 + Vec::loadu(x + j);
    s1 = s1 + Vec::loadu(x + j + W);
    s2 = s2 + Vec::loadu(x + j + 2 * W);
    s3 = s3 + Vec::loadu(x + j + 3 * W);
  }
  for (; j < c; j += W) s0 = s0 + Vec::loadu(x + j, std::min(W, c - j));  // zero-padded
  const Vec s = (s0 + s1) + (s2 + s3);
  return at::vec::vec_reduce_all<T>([](Vec& a, Vec& b) { return a + b; }, s);
}

// Runs one program on rows of at most `ld` columns; one per thread (its registers are
// scratch).  dcaptured[a]: where SCATTER adds capture a's gradient (nullptr: not wanted).
template <typename T>
class Runner {
 public:
  struct Oob {  // an out-of-bounds position: instruction, column (-1: every column)
    int64_t instr, column;
  };
  std::vector<T*> dcaptured;
  std::vector<Oob> oob;  // this row's, in instruction order

  Runner(const Program& pg, int64_t ld)
      : dcaptured(pg.captured.size(), nullptr), pg_(&pg), ld_(std::max<int64_t>(ld, 1)) {
    fbuf_.resize(pg.f_slots * ld_);
    ibuf_.resize(pg.i_slots * ld_);
    f_.assign(pg.kind.size(), nullptr);
    i_.assign(pg.kind.size(), nullptr);
    cached_.assign(pg.kind.size(), 0);
    cached_from_.assign(pg.kind.size(), -1);
    for (size_t r = 0; r < pg.kind.size(); ++r) {
      if (pg.slot[r] < 0) continue;
      if (pg.kind[r] == Kind::F) f_[r] = fbuf_.data() + pg.slot[r] * ld_;
      else i_[r] = ibuf_.data() + pg.slot[r] * ld_;
    }
  }

  // The program on row (b, h, i) over columns j0 .. j0 + c (c <= ld): SCORE = score[0 .. c),
  // GRAD = grad[0 .. c); returns the `out` register's row: dest itself where the program
  // could write it there (dest may be score or grad; nullptr: none), else a row the caller
  // copies (score or grad themselves when out is the register that loads them).
  const T* run(int64_t b, int64_t h, int64_t i, int64_t j0, int64_t c, const T* score,
               const T* grad, T* dest = nullptr) {
    if (pg_->direct_out) {
      const bool alias = dest != nullptr && (dest == score || dest == grad);
      const bool direct = dest != nullptr && (!alias || pg_->out_instr >= pg_->last_load_read);
      f_[pg_->out] = direct ? dest : fbuf_.data() + pg_->slot[pg_->out] * ld_;
    }
    exec(b, h, i, j0, c, score, grad);
    return f_[pg_->out];
  }

  // A mask program on row (b, h, i) over keys j0 .. j0 + c (c <= ld): nonzero where kept.
  const int64_t* verdict(int64_t b, int64_t h, int64_t i, int64_t j0, int64_t c) {
    exec(b, h, i, j0, c, nullptr, nullptr);
    return i_[pg_->out];
  }

  // The message for out-of-bounds position e, its index registers read at `column` (0 for a
  // uniform instruction), at (b, h, q_idx = i, kv_idx = j).
  std::string describe(const Oob& e, int64_t b, int64_t h, int64_t i, int64_t j) const {
    const Instr& in = pg_->code[e.instr];
    const Capture& cap = pg_->captured[in.a];
    const int64_t column = e.column < 0 ? 0 : e.column;
    std::ostringstream s;
    s << "attngrad_fused: " << pg_->function << " "
      << (in.op == Op::SCATTER ? "adds the gradient of" : "reads") << " captured tensor "
      << in.a << " of shape " << cap.t.sizes() << " at index (";
    for (int64_t x = 0; x < in.c; ++x)
      s << (x ? ", " : "") << i_[pg_->indices[in.b + x]][column];
    s << ") (position b=" << b << ", h=" << h << ", q_idx=" << i << ", kv_idx=" << j
      << "), out of its bounds: index captured tensors within their sizes (a negative index "
      << "counts from the end once), or mask the position out";
    return s.str();
  }

 private:
  // The program's instructions on one row; `out`'s register then holds the result.
  void exec(int64_t b, int64_t h, int64_t i, int64_t j0, int64_t c, const T* score,
            const T* grad) {
    using Vec = at::vec::Vectorized<T>;
    oob.clear();
    const int64_t count = static_cast<int64_t>(pg_->code.size());
    for (int64_t k = 0; k < count; ++k) {
      const Instr& in = pg_->code[k];
      const int64_t n = in.uniform ? 1 : c;
      if (in.op == Op::CONST_F || in.op == Op::CONST_I || in.op == Op::KEY) {
        // the same values on every row: kept from an earlier row while they still fit
        const int64_t from = in.op == Op::KEY ? j0 : 0;
        if (cached_from_[in.dst] == from && cached_[in.dst] >= c) continue;
        cached_from_[in.dst] = from;
        cached_[in.dst] = in.uniform && !pg_->expand[in.dst] ? ld_ : c;
      }
      switch (in.op) {
        // SCORE and GRAD alias the rows they load (registers are never written twice)
        case Op::SCORE: f_[in.dst] = const_cast<T*>(score); continue;
        case Op::GRAD: f_[in.dst] = const_cast<T*>(grad); continue;
        case Op::BATCH: std::fill_n(i_[in.dst], n, b % pg_->batch); break;
        case Op::HEAD: std::fill_n(i_[in.dst], n, h); break;
        case Op::QUERY: std::fill_n(i_[in.dst], n, i); break;
        case Op::KEY: {
          int64_t* d = i_[in.dst];
          for (int64_t j = 0; j < n; ++j) d[j] = j0 + j;
          break;
        }
        case Op::CONST_F: std::fill_n(f_[in.dst], n, static_cast<T>(in.constant)); break;
        case Op::CONST_I: std::fill_n(i_[in.dst], n, in.integer); break;
        case Op::GATHER_F: gather(k, in, n, f_[in.dst]); break;
        case Op::GATHER_I: gather(k, in, n, i_[in.dst]); break;
        case Op::SCATTER: scatter(k, in, c); continue;
        case Op::ADD_F: fmap2(in, n, [](Vec x, Vec y) { return x + y; }); break;
        case Op::SUB_F: fmap2(in, n, [](Vec x, Vec y) { return x - y; }); break;
        case Op::MUL_F: fmap2(in, n, [](Vec x, Vec y) { return x * y; }); break;
        case Op::DIV_F: fmap2(in, n, [](Vec x, Vec y) { return x / y; }); break;
        case Op::MIN_F: fmap2(in, n, [](Vec x, Vec y) { return at::vec::minimum(x, y); }); break;
        case Op::MAX_F: fmap2(in, n, [](Vec x, Vec y) { return at::vec::maximum(x, y); }); break;
        case Op::FLOORDIV_F: fmap2(in, n, [](Vec x, Vec y) { return floordiv_vec(x, y); }); break;
        case Op::REMAINDER_F:
          fmap2(in, n, [](Vec x, Vec y) { return remainder_vec(x, y); });
          break;
        case Op::NEG_F: fmap1(in, n, [](Vec x) { return x.neg(); }); break;
        case Op::ABS_F: fmap1(in, n, [](Vec x) { return x.abs(); }); break;
        case Op::EXP_F: fmap1(in, n, [](Vec x) { return x.exp(); }); break;
        case Op::LOG_F: fmap1(in, n, [](Vec x) { return x.log(); }); break;
        case Op::TANH_F: fmap1(in, n, [](Vec x) { return tanh_vec(x); }); break;
        case Op::SIGMOID_F:  // as torch's CPU sigmoid: 1 / (1 + e^-x)
          fmap1(in, n, [](Vec x) { return Vec(T(1)) / (Vec(T(1)) + x.neg().exp()); });
          break;
        case Op::SQRT_F: fmap1(in, n, [](Vec x) { return x.sqrt(); }); break;
        case Op::FLOOR_F: fmap1(in, n, [](Vec x) { return x.floor(); }); break;
        case Op::LT_F: fcompare(in, n, [](T x, T y) { return x < y; }); break;
        case Op::LE_F: fcompare(in, n, [](T x, T y) { return x <= y; }); break;
        case Op::GT_F: fcompare(in, n, [](T x, T y) { return x > y; }); break;
        case Op::GE_F: fcompare(in, n, [](T x, T y) { return x >= y; }); break;
        case Op::EQ_F: fcompare(in, n, [](T x, T y) { return x == y; }); break;
        case Op::NE_F: fcompare(in, n, [](T x, T y) { return x != y; }); break;
        case Op::ADD_I: imap2(in, n, [](int64_t x, int64_t y) { return wrap(bits(x) + bits(y)); }); break;
        case Op::SUB_I: imap2(in, n, [](int64_t x, int64_t y) { return wrap(bits(x) - bits(y)); }); break;
        case Op::MUL_I: imap2(in, n, [](int64_t x, int64_t y) { return wrap(bits(x) * bits(y)); }); break;
        case Op::MIN_I: imap2(in, n, [](int64_t x, int64_t y) { return std::min(x, y); }); break;
        case Op::MAX_I: imap2(in, n, [](int64_t x, int64_t y) { return std::max(x, y); }); break;
        case Op::AND_I: imap2(in, n, [](int64_t x, int64_t y) { return x & y; }); break;
        case Op::OR_I: imap2(in, n, [](int64_t x, int64_t y) { return x | y; }); break;
        case Op::XOR_I: imap2(in, n, [](int64_t x, int64_t y) { return x ^ y; }); break;
        case Op::FLOORDIV_I:
          nonzero(k, in, n);
          if (!divides_uniformly(in, n, false))
            imap2(in, n, [](int64_t x, int64_t y) { return floordiv_int(x, y); });
          break;
        case Op::REMAINDER_I:
          nonzero(k, in, n);
          if (!divides_uniformly(in, n, true))
            imap2(in, n, [](int64_t x, int64_t y) { return remainder_int(x, y); });
          break;
        case Op::NEG_I: imap1(in, n, [](int64_t x) { return wrap(0 - bits(x)); }); break;
        case Op::ABS_I: imap1(in, n, [](int64_t x) { return x < 0 ? wrap(0 - bits(x)) : x; }); break;
        case Op::NOT_I: imap1(in, n, [](int64_t x) { return ~x; }); break;
        case Op::LT_I: imap2(in, n, [](int64_t x, int64_t y) -> int64_t { return x < y; }); break;
        case Op::LE_I: imap2(in, n, [](int64_t x, int64_t y) -> int64_t { return x <= y; }); break;
        case Op::GT_I: imap2(in, n, [](int64_t x, int64_t y) -> int64_t { return x > y; }); break;
        case Op::GE_I: imap2(in, n, [](int64_t x, int64_t y) -> int64_t { return x >= y; }); break;
        case Op::EQ_I: imap2(in, n, [](int64_t x, int64_t y) -> int64_t { return x == y; }); break;
        case Op::NE_I: imap2(in, n, [](int64_t x, int64_t y) -> int64_t { return x != y; }); break;
        case Op::WHERE_F: where(in, n, f_[in.dst], f_[in.b], f_[in.c]); break;
        case Op::WHERE_I: where(in, n, i_[in.dst], i_[in.b], i_[in.c]); break;
        case Op::TO_F: to_float(i_[in.a], f_[in.dst], n); break;
        case Op::TO_I: {
          const T* x = f_[in.a];
          int64_t* d = i_[in.dst];
          for (int64_t j = 0; j < n; ++j) d[j] = to_int(x[j]);
          break;
        }
        case Op::kCount: break;
      }
      if (in.uniform && pg_->expand[in.dst]) {  // lane 0 over the row, for per-column readers
        if (pg_->kind[in.dst] == Kind::F) std::fill(f_[in.dst] + 1, f_[in.dst] + c, f_[in.dst][0]);
        else std::fill(i_[in.dst] + 1, i_[in.dst] + c, i_[in.dst][0]);
      }
    }
  }

  template <typename Fn>
  void fmap1(const Instr& in, int64_t n, const Fn& fn) {
    at::vec::map(fn, f_[in.dst], f_[in.a], n);
  }
  // A binary F op; a uniform operand (lane 0 alone) enters as a broadcast vector.
  template <typename Fn>
  void fmap2(const Instr& in, int64_t n, const Fn& fn) {
    using Vec = at::vec::Vectorized<T>;
    const T *x = f_[in.a], *y = f_[in.b];
    T* d = f_[in.dst];
    const bool ux = pg_->uniform[in.a], uy = pg_->uniform[in.b];
    if (ux && uy) {
      const Vec r = fn(Vec(x[0]), Vec(y[0]));  // every lane the same
      for (int64_t j = 0; j < n; j += Vec::size()) r.store(d + j, std::min<int64_t>(Vec::size(), n - j));
    } else if (ux) {
      const Vec a(x[0]);
      at::vec::map([&](Vec b) { return fn(a, b); }, d, y, n);
    } else if (uy) {
      const Vec b(y[0]);
      at::vec::map([&](Vec a) { return fn(a, b); }, d, x, n);
    } else {
      at::vec::map2(fn, d, x, y, n);
    }
  }
  // A binary op of plain loops (I ops, comparisons), a uniform operand read as a scalar.
  template <typename V, typename Fn>
  void binary(const Instr& in, int64_t n, const V* x, const V* y, int64_t* d, const Fn& fn) {
    const bool ux = pg_->uniform[in.a], uy = pg_->uniform[in.b];
    if (ux && uy) {
      std::fill_n(d, n, static_cast<int64_t>(fn(x[0], y[0])));
    } else if (ux) {
      const V a = x[0];
      for (int64_t j = 0; j < n; ++j) d[j] = fn(a, y[j]);
    } else if (uy) {
      const V b = y[0];
      for (int64_t j = 0; j < n; ++j) d[j] = fn(x[j], b);
    } else {
      for (int64_t j = 0; j < n; ++j) d[j] = fn(x[j], y[j]);
    }
  }
  template <typename Fn>
  void fcompare(const Instr& in, int64_t n, const Fn& fn) {
    binary(in, n, f_[in.a], f_[in.b], i_[in.dst], fn);
  }
  template <typename Fn>
  void imap1(const Instr& in, int64_t n, const Fn& fn) {
    const int64_t* x = i_[in.a];
    int64_t* d = i_[in.dst];
    for (int64_t j = 0; j < n; ++j) d[j] = fn(x[j]);
  }
  template <typename Fn>
  void imap2(const Instr& in, int64_t n, const Fn& fn) {
    binary(in, n, i_[in.a], i_[in.b], i_[in.dst], fn);
  }
  // int64 -> T rounded to nearest, as static_cast, in a form compilers vectorise (AVX2 has
  // no int64 -> float instruction): within [-2^51, 2^51) the bits of 1.5 * 2^52 plus the
  // int are the double 1.5 * 2^52 + x, exactly; minus 1.5 * 2^52 is x, then one rounding to T.
  static void to_float(const int64_t* x, T* d, int64_t n) {
    constexpr uint64_t half = uint64_t(1) << 51, magic = 0x4338000000000000ull;  // 1.5 * 2^52
    uint64_t outside = 0;  // bits at 2^52 and up of x + 2^51: some x beyond the range
    for (int64_t j = 0; j < n; ++j) {
      outside |= (bits(x[j]) + half) & ~(2 * half - 1);
      const uint64_t u = bits(x[j]) + magic;
      double v;
      std::memcpy(&v, &u, sizeof v);
      d[j] = static_cast<T>(v - 6755399441055744.0);
    }
    if (outside != 0)
      for (int64_t j = 0; j < n; ++j) d[j] = static_cast<T>(x[j]);
  }
  template <typename V>
  void where(const Instr& in, int64_t n, V* d, const V* x, const V* y) {
    const int64_t* cond = i_[in.a];
    for (int64_t j = 0; j < n; ++j) d[j] = cond[j] != 0 ? x[j] : y[j];
  }
  // FLOORDIV_I / REMAINDER_I of a row by a uniform divisor through `divide_uniform`, where
  // it is exact; false where the caller divides per column.
  bool divides_uniformly(const Instr& in, int64_t n, bool remainder) {
    if (in.uniform || !pg_->uniform[in.b] || pg_->uniform[in.a]) return false;
    const int64_t *x = i_[in.a], y = i_[in.b][0];
    return remainder ? divide_uniform<true>(x, y, n, i_[in.dst])
                     : divide_uniform<false>(x, y, n, i_[in.dst]);
  }
  void nonzero(int64_t k, const Instr& in, int64_t n) const {
    const int64_t* y = i_[in.b];
    if (pg_->uniform[in.b]) n = 1;
    for (int64_t j = 0; j < n; ++j)
      TORCH_CHECK(y[j] != 0, "attngrad_fused: ZeroDivisionError: ", pg_->function,
                  "'s instruction ", k, " (", op_info(in.op).name, ") divides an integer by zero");
  }

  // The flat position of the capture's element that instruction `in` indexes at column j,
  // false where it is out of bounds.
  bool position(const Instr& in, int64_t j, int64_t& flat) const {
    const Capture& cap = pg_->captured[in.a];
    flat = 0;
    bool ok = true;
    for (int64_t x = 0; x < in.c; ++x) {
      int64_t p = i_[pg_->indices[in.b + x]][j];
      const int64_t size = cap.sizes[x];
      if (p < 0) p += size;
      ok = ok && p >= 0 && p < size;
      flat += p * cap.strides[x];
    }
    return ok && cap.numel > 0;
  }

  template <typename V>
  void gather(int64_t k, const Instr& in, int64_t n, V* d) {
    const Capture& cap = pg_->captured[in.a];
    const V* data = static_cast<const V*>(cap.t.data_ptr());
    if (in.c == 1 && cap.numel > 0) {  // the common case, without a branch per column
      const int64_t* x = i_[pg_->indices[in.b]];
      const int64_t size = cap.sizes[0];
      bool bad = false;
      for (int64_t j = 0; j < n; ++j) {
        const int64_t p = x[j] < 0 ? x[j] + size : x[j];
        const bool ok = p >= 0 && p < size;
        d[j] = ok ? data[ok ? p : 0] : V(0);
        bad |= !ok;
      }
      if (!bad) return;
    }
    for (int64_t j = 0; j < n; ++j) {
      int64_t flat;
      if (position(in, j, flat)) {
        d[j] = data[flat];
      } else {
        d[j] = V(0);
        oob.push_back({k, in.uniform ? -1 : j});
      }
    }
  }

  void scatter(int64_t k, const Instr& in, int64_t c) {
    T* acc = dcaptured[in.a];
    if (acc == nullptr) return;
    const T* v = f_[in.dst];
    int64_t flat;
    if (in.one_position) {  // one element for the whole row: the row's sum, added once
      if (position(in, 0, flat)) acc[flat] += row_sum(v, c);
      else oob.push_back({k, -1});
      return;
    }
    for (int64_t j = 0; j < c; ++j) {
      if (position(in, j, flat)) acc[flat] += v[j];
      else oob.push_back({k, j});
    }
  }

  const Program* pg_;
  int64_t ld_;
  // CONST_F, CONST_I, KEY: the columns their register holds from an earlier row (cached_)
  // and, for KEY, the key they start at (cached_from_)
  std::vector<int64_t> cached_, cached_from_;
  std::vector<T> fbuf_;
  std::vector<int64_t> ibuf_;
  std::vector<T*> f_;        // per register: its row
  std::vector<int64_t*> i_;
};

}  // namespace attngrad_fused
