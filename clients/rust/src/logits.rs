//! Logits as views over a reply's bytes: full logits arrive as raw little-endian rows in
//! `Logits.values.data` (a `bytes::Bytes` slice of the received message, not a copy).

use crate::pb;
use bytes::Bytes;

/// Full logits of one or more positions, read in place from the reply.
#[derive(Debug, Clone)]
pub struct LogitsView {
    data: Bytes,
    dtype: pb::DType,
    rows: usize,
    vocab: usize,
}

impl LogitsView {
    /// The view of a reply's FULL logits (None for TOP_K / ARGMAX / shared memory).
    pub fn of(logits: &pb::Logits) -> Option<Self> {
        let values = logits.values.as_ref()?;
        let dtype = pb::DType::try_from(values.dtype).unwrap_or(pb::DType::DtypeFloat32);
        let elem = match dtype {
            pb::DType::DtypeFloat32 | pb::DType::DtypeUnspecified => 4,
            pb::DType::DtypeFloat16 | pb::DType::DtypeBfloat16 => 2,
            _ => return None,
        };
        let vocab = *values.shape.last()? as usize;
        if vocab == 0 || values.data.len() % (vocab * elem) != 0 || values.data.is_empty() {
            return None;
        }
        let rows = values.data.len() / (vocab * elem);
        Some(LogitsView { data: values.data.clone(), dtype, rows, vocab })
    }

    /// Positions (rows).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Vocabulary entries per row.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// The element type on the wire.
    pub fn dtype(&self) -> pb::DType {
        self.dtype
    }

    /// The raw little-endian bytes (all rows).
    pub fn bytes(&self) -> &[u8] {
        &self.data
    }

    /// Row `row` as float32 without a copy, where the dtype is FLOAT32 and the bytes
    /// happen to be 4-byte aligned in memory (little-endian hosts).
    pub fn row_f32_slice(&self, row: usize) -> Option<&[f32]> {
        if self.dtype != pb::DType::DtypeFloat32 || row >= self.rows || cfg!(target_endian = "big") {
            return None;
        }
        let bytes = &self.data[row * self.vocab * 4..(row + 1) * self.vocab * 4];
        // SAFETY: every bit pattern is a valid f32; align_to only yields the aligned middle.
        let (head, body, tail) = unsafe { bytes.align_to::<f32>() };
        (head.is_empty() && tail.is_empty()).then_some(body)
    }

    /// One element as float32 (half types widened exactly).
    pub fn get(&self, row: usize, col: usize) -> f32 {
        let i = row * self.vocab + col;
        match self.dtype {
            pb::DType::DtypeFloat16 => half::f16::from_le_bytes([self.data[2 * i], self.data[2 * i + 1]]).to_f32(),
            pb::DType::DtypeBfloat16 => half::bf16::from_le_bytes([self.data[2 * i], self.data[2 * i + 1]]).to_f32(),
            _ => f32::from_le_bytes(self.data[4 * i..4 * i + 4].try_into().unwrap()),
        }
    }

    /// Row `row` as float32 values (copied; exact for every dtype).
    pub fn row_to_vec(&self, row: usize) -> Vec<f32> {
        if let Some(s) = self.row_f32_slice(row) {
            return s.to_vec();
        }
        (0..self.vocab).map(|c| self.get(row, c)).collect()
    }

    /// The index of row `row`'s largest value (the first on ties), as greedy picks.
    pub fn argmax(&self, row: usize) -> u32 {
        let mut best = (0usize, f32::NEG_INFINITY);
        for c in 0..self.vocab {
            let v = self.get(row, c);
            if v > best.1 {
                best = (c, v);
            }
        }
        best.0 as u32
    }
}
