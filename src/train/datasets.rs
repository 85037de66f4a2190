//! The run's data: the train, validation and test splits it reads (GPT pretraining samples or
//! MindSpeed-LLM fine-tuning samples), checked against the model's vocabulary.

use super::data;
use super::trainer::Trainer;
use crate::data::gpt_dataset::{build_splits, SampleConfig};
use crate::data::sft_dataset::{index as sft_index, legacy_split, PairwiseDataset, SftDataset};
use crate::engine::Backend;
use anyhow::{bail, Result};
use std::sync::Arc;

impl<B: Backend> Trainer<B> {
    /// The data of every split the run reads.
    pub(super) fn datasets(&self) -> Result<[Option<data::Source>; 3]> {
        let c = &self.cfg;
        let (valid, test) = match c.eval_samples {
            Some((valid, test)) => (Some(valid), Some(test)),
            None => (None, None),
        };
        if let Some(sft) = &c.sft {
            type Build = Box<dyn Fn(Vec<u64>) -> data::Source>;
            let rows = sft.rows;
            let (len, make): (usize, Build) = if sft.pairwise {
                let data = Arc::new(PairwiseDataset::open(&sft.prefix)?);
                let len = data.len();
                (
                    len,
                    Box::new(move |index| data::Source::Pairwise {
                        data: data.clone(),
                        index,
                        rows,
                    }),
                )
            } else {
                let data = Arc::new(SftDataset::open(&sft.prefix)?);
                let len = data.len();
                (
                    len,
                    Box::new(move |index| data::Source::Sft {
                        data: data.clone(),
                        index,
                        rows,
                    }),
                )
            };
            let source = |range, n| make(sft_index(range, n, sft.order));
            let ranges = legacy_split(&c.split, len)?;
            if ranges[0].is_empty() {
                bail!(
                    "{}: the train split of --split {:?} holds none of its {} samples",
                    sft.prefix.display(),
                    c.split,
                    len
                );
            }
            let train = source(ranges[0].clone(), c.train_samples);
            let valid = valid
                .map(|n| source(ranges[1].clone(), n))
                .filter(|v| !v.is_empty());
            let test = test
                .map(|n| source(ranges[2].clone(), n))
                .filter(|t| !t.is_empty());
            return Ok([Some(train), valid, test]);
        }
        let wanted = [true, c.eval.is_some(), c.eval.is_some()];
        let [train, valid, test] = build_splits(
            &c.blend,
            &c.split,
            [Some(c.train_samples), valid, test],
            wanted,
            &SampleConfig {
                seq_length: c.seq_length,
                seed: c.seed,
                surplus: c.surplus,
            },
        )?;
        let source = |samples| data::Source::Pretrain {
            samples,
            masks: c.masks,
        };
        Ok([train.map(source), valid.map(source), test.map(source)])
    }

    /// The lm loss is token-weighted except for MindSpeed-LLM's fine-tuning default.
    pub(super) fn token_weighted(&self) -> bool {
        self.cfg.sft.is_none() || self.cfg.averaging == data::LossAveraging::PerToken
    }

    /// Check the data's token ids against the model's vocabulary before any work.
    pub(super) fn check_vocab(&self) -> Result<()> {
        for prefix in &self.cfg.blend.prefixes {
            let max = match &self.cfg.sft {
                Some(sft) if sft.pairwise => PairwiseDataset::open(&sft.prefix)?.max_token(),
                Some(sft) => SftDataset::open(&sft.prefix)?.max_token(),
                None => crate::data::indexed::IndexedDataset::open(prefix)?.max_token(),
            };
            if max >= self.cfg.vocab_padded as i64 {
                bail!(
                    "{}: token id {max} is outside the model's vocabulary of {} (padded {}): the \
                     data was made with another tokenizer",
                    prefix.display(),
                    self.cfg.model.vocab,
                    self.cfg.vocab_padded
                );
            }
        }
        Ok(())
    }
}
