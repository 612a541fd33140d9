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

/// The Arrow type of a JSON value as pyarrow infers it from Python objects: objects become
/// structs (fields in key order), arrays lists of their first element's type, integers `int64`,
/// other numbers `float64`. `null` becomes the null type.
fn json_type(v: &serde_json::Value) -> DataType {
    use serde_json::Value;
    match v {
        Value::Null => DataType::Null,
        Value::Bool(_) => DataType::Boolean,
        Value::Number(n) if n.is_i64() => DataType::Int64,
        Value::Number(_) => DataType::Float64,
        Value::String(_) => DataType::Utf8,
        Value::Array(a) => DataType::List(Arc::new(Field::new(
            LIST_ITEM,
            a.first().map_or(DataType::Null, json_type),
            true,
        ))),
        Value::Object(o) => DataType::Struct(Fields::from(
            o.iter()
                .map(|(k, v)| Field::new(k, json_type(v), true))
                .collect::<Vec<_>>(),
        )),
    }
}

/// A column of `values` (one per row, all of the first non-null value's shape; a missing
/// struct field is null). `Err` names the first value that does not fit that shape.
pub(crate) fn json_column(values: &[serde_json::Value]) -> Result<ArrayRef, String> {
    let ty = values
        .iter()
        .find(|v| !v.is_null())
        .map_or(DataType::Null, json_type);
    json_array(values.iter().collect(), &ty)
}

fn json_array(values: Vec<&serde_json::Value>, ty: &DataType) -> Result<ArrayRef, String> {
    use arrow_array::{BooleanArray, Float64Array, Int64Array, NullArray};
    use arrow_buffer::NullBuffer;
    use serde_json::Value;
    let mismatch = |v: &Value| format!("a value of type {ty}, found {v}");
    let valid = NullBuffer::from(values.iter().map(|v| !v.is_null()).collect::<Vec<_>>());
    let nulls = (valid.null_count() > 0).then_some(valid);
    let out: ArrayRef = match ty {
        DataType::Null => Arc::new(NullArray::new(values.len())),
        DataType::Boolean => Arc::new(
            values
                .iter()
                .map(|v| match v {
                    Value::Null => Ok(None),
                    Value::Bool(b) => Ok(Some(*b)),
                    v => Err(mismatch(v)),
                })
                .collect::<Result<BooleanArray, _>>()?,
        ),
        DataType::Int64 => Arc::new(
            values
                .iter()
                .map(|v| match v {
                    Value::Null => Ok(None),
                    v => v.as_i64().map(Some).ok_or_else(|| mismatch(v)),
                })
                .collect::<Result<Int64Array, _>>()?,
        ),
        DataType::Float64 => Arc::new(
            values
                .iter()
                .map(|v| match v {
                    Value::Null => Ok(None),
                    v => v.as_f64().map(Some).ok_or_else(|| mismatch(v)),
                })
                .collect::<Result<Float64Array, _>>()?,
        ),
        DataType::Utf8 => Arc::new(
            values
                .iter()
                .map(|v| match v {
                    Value::Null => Ok(None),
                    Value::String(s) => Ok(Some(s.as_str())),
                    v => Err(mismatch(v)),
                })
                .collect::<Result<StringArray, _>>()?,
        ),
        DataType::List(item) => {
            let mut lengths = Vec::with_capacity(values.len());
            let mut children = Vec::new();
            for v in &values {
                match v {
                    Value::Null => lengths.push(0),
                    Value::Array(a) => {
                        lengths.push(a.len());
                        children.extend(a.iter());
                    }
                    v => return Err(mismatch(v)),
                }
            }
            let child = json_array(children, item.data_type())?;
            Arc::new(ListArray::new(
                item.clone(),
                OffsetBuffer::from_lengths(lengths),
                child,
                nulls,
            ))
        }
        DataType::Struct(fields) => {
            for v in &values {
                if !matches!(v, Value::Null | Value::Object(_)) {
                    return Err(mismatch(v));
                }
            }
            let columns = fields
                .iter()
                .map(|f| {
                    let child = values
                        .iter()
                        .map(|v| v.get(f.name()).unwrap_or(&Value::Null))
                        .collect();
                    json_array(child, f.data_type())
                        .map_err(|e| format!("field `{}`: {e}", f.name()))
                })
                .collect::<Result<Vec<_>, _>>()?;
            Arc::new(StructArray::new(fields.clone(), columns, nulls))
        }
        other => return Err(format!("a JSON-representable type, found {other}")),
    };
    Ok(out)
}
