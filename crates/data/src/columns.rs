//! The Arrow shapes every verl-format preprocessing script writes (`prompt` as a list of chat
//! messages, `reward_model` as `{style, ground_truth}`), with the nested field names pyarrow
//! gives them, so each dataset module only adds its own columns.

use std::sync::Arc;

use arrow_array::{ArrayRef, ListArray, StringArray, StructArray};
use arrow_buffer::OffsetBuffer;
use arrow_schema::{DataType, Field, Fields};

/// Name of the list item field. pyarrow writes parquet lists with the spec's `element` and
/// reads them back under that name.
const LIST_ITEM: &str = "element";

pub(crate) fn utf8(name: &str) -> Field {
    Field::new(name, DataType::Utf8, true)
}

/// A non-null string column.
pub(crate) fn strings<S: AsRef<str>>(values: impl IntoIterator<Item = S>) -> ArrayRef {
    Arc::new(StringArray::from_iter_values(values))
}

fn message_fields() -> Fields {
    Fields::from(vec![utf8("role"), utf8("content")])
}

fn prompt_item() -> Arc<Field> {
    Arc::new(Field::new(
        LIST_ITEM,
        DataType::Struct(message_fields()),
        true,
    ))
}

/// `prompt: list<struct<role, content>>`.
pub(crate) fn prompt_field() -> Field {
    Field::new("prompt", DataType::List(prompt_item()), true)
}

/// One single-message `user` prompt per row.
pub(crate) fn user_prompts(contents: Vec<String>) -> ArrayRef {
    let n = contents.len();
    let messages = StructArray::new(
        message_fields(),
        vec![strings(std::iter::repeat_n("user", n)), strings(contents)],
        None,
    );
    Arc::new(ListArray::new(
        prompt_item(),
        OffsetBuffer::from_lengths(std::iter::repeat_n(1, n)),
        Arc::new(messages),
        None,
    ))
}

fn reward_fields() -> Fields {
    Fields::from(vec![utf8("style"), utf8("ground_truth")])
}

/// `reward_model: struct<style, ground_truth>`.
pub(crate) fn reward_field() -> Field {
    Field::new("reward_model", DataType::Struct(reward_fields()), true)
}

/// `{style: "rule", ground_truth}` per row.
pub(crate) fn rule_rewards<S: AsRef<str>>(truths: impl ExactSizeIterator<Item = S>) -> ArrayRef {
    let n = truths.len();
    Arc::new(StructArray::new(
        reward_fields(),
        vec![strings(std::iter::repeat_n("rule", n)), strings(truths)],
        None,
    ))
}
