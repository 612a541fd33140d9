//! A HF model folder's tokenizer: `tokenizer.json` through the `tokenizers` crate, with the
//! special tokens, BOS/EOS policy, decode clean-up and chat templates that transformers takes
//! from `tokenizer_config.json`, `special_tokens_map.json`, `chat_template.jinja` and
//! `generation_config.json`.

use crate::error::{describe_json, ChatError, Result};
use crate::template::{ChatOptions, ChatTemplate};
use serde::Serialize;
use serde_json::Value as Json;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::processors::PostProcessorWrapper;
use tokenizers::AddedToken;

pub const TOKENIZER_FILE: &str = "tokenizer.json";
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";
pub const SPECIAL_TOKENS_MAP_FILE: &str = "special_tokens_map.json";
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";
pub const CHAT_TEMPLATE_JSON_FILE: &str = "chat_template.json";
pub const ADDITIONAL_CHAT_TEMPLATES_DIR: &str = "additional_chat_templates";

/// The named special tokens of HF's `SPECIAL_TOKENS_ATTRIBUTES`, in its order.
const SPECIAL_TOKEN_FIELDS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// Special tokens as strings, as the config files name them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    pub bos: Option<String>,
    pub eos: Option<String>,
    pub unk: Option<String>,
    pub sep: Option<String>,
    pub pad: Option<String>,
    pub cls: Option<String>,
    pub mask: Option<String>,
    pub additional: Vec<String>,
}

impl SpecialTokens {
    fn slot(&mut self, field: &str) -> &mut Option<String> {
        match field {
            "bos_token" => &mut self.bos,
            "eos_token" => &mut self.eos,
            "unk_token" => &mut self.unk,
            "sep_token" => &mut self.sep,
            "pad_token" => &mut self.pad,
            "cls_token" => &mut self.cls,
            "mask_token" => &mut self.mask,
            _ => unreachable!("not a special-token field: {field}"),
        }
    }

    fn get(&self, field: &str) -> Option<&String> {
        match field {
            "bos_token" => self.bos.as_ref(),
            "eos_token" => self.eos.as_ref(),
            "unk_token" => self.unk.as_ref(),
            "sep_token" => self.sep.as_ref(),
            "pad_token" => self.pad.as_ref(),
            "cls_token" => self.cls.as_ref(),
            "mask_token" => self.mask.as_ref(),
            _ => None,
        }
    }

    /// HF's `special_tokens_map`: the variables every chat template receives.
    pub fn template_vars(&self) -> serde_json::Map<String, Json> {
        let mut vars = serde_json::Map::new();
        for field in SPECIAL_TOKEN_FIELDS {
            if let Some(tok) = self.get(field) {
                vars.insert(field.to_owned(), Json::String(tok.clone()));
            }
        }
        if !self.additional.is_empty() {
            vars.insert(
                "additional_special_tokens".into(),
                Json::Array(self.additional.iter().cloned().map(Json::String).collect()),
            );
        }
        vars
    }
}

/// The chat templates a folder declares: HF allows one unnamed template or several named ones.
#[derive(Debug, Default)]
pub struct ChatTemplates {
    /// Keyed by name; a single unnamed template is stored as `default`.
    templates: BTreeMap<String, ChatTemplate>,
}

impl ChatTemplates {
    pub fn is_empty(&self) -> bool {
        self.templates.is_empty()
    }

    pub fn names(&self) -> Vec<String> {
        self.templates.keys().cloned().collect()
    }

    pub fn get(&self, name: &str) -> Option<&ChatTemplate> {
        self.templates.get(name)
    }

    /// HF's `get_chat_template`: an explicit name wins; otherwise `tool_use` when tools are
    /// given and such a template exists; otherwise `default`.
    fn select(&self, dir: &Path, opts: &ChatOptions) -> Result<&ChatTemplate> {
        if self.templates.is_empty() {
            return Err(ChatError::NoChatTemplate {
                dir: dir.to_path_buf(),
            });
        }
        if let Some(name) = &opts.template_name {
            return self
                .templates
                .get(name)
                .ok_or_else(|| ChatError::UnknownTemplateName {
                    name: name.clone(),
                    available: self.names(),
                });
        }
        if opts.tools.is_some() {
            if let Some(t) = self.templates.get("tool_use") {
                return Ok(t);
            }
        }
        self.templates
            .get("default")
            .ok_or_else(|| ChatError::AmbiguousTemplate {
                available: self.names(),
            })
    }
}

/// A tokenizer loaded from a HF model folder.
#[derive(Debug)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    dir: PathBuf,
    special: SpecialTokens,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    pad_id: Option<u32>,
    generation_eos_ids: Vec<u32>,
    eos_token_ids: Vec<u32>,
    clean_up_tokenization_spaces: bool,
    padding_side: Option<String>,
    model_max_length: Option<u64>,
    templates: ChatTemplates,
}

fn read_text(path: &Path, needed_for: &str) -> Result<String> {
    std::fs::read_to_string(path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            ChatError::MissingFile {
                path: path.to_path_buf(),
                needed_for: needed_for.to_owned(),
            }
        } else {
            ChatError::Io {
                path: path.to_path_buf(),
                source,
            }
        }
    })
}

/// Reads a JSON object file; `Ok(None)` when the file does not exist.
fn read_optional_json_object(path: &Path) -> Result<Option<serde_json::Map<String, Json>>> {
    if !path.exists() {
        return Ok(None);
    }
    let text = read_text(path, "optional")?;
    let value: Json = serde_json::from_str(&text).map_err(|source| ChatError::Json {
        path: path.to_path_buf(),
        source,
    })?;
    match value {
        Json::Object(map) => Ok(Some(map)),
        other => Err(ChatError::Field {
            path: path.to_path_buf(),
            field: "<top level>".into(),
            expected: "a JSON object".into(),
            found: describe_json(&other),
        }),
    }
}

fn field_error(path: &Path, field: &str, expected: &str, found: &Json) -> ChatError {
    ChatError::Field {
        path: path.to_path_buf(),
        field: field.to_owned(),
        expected: expected.to_owned(),
        found: describe_json(found),
    }
}

/// A special token given as a string, as null, or as a serialized `AddedToken`
/// (`{"__type": "AddedToken", "content": "<s>", ...}`).
fn token_content(path: &Path, field: &str, value: &Json) -> Result<Option<String>> {
    const EXPECTED: &str = "a string, null, or an AddedToken object with a string `content`";
    match value {
        Json::Null => Ok(None),
        Json::String(s) => Ok(Some(s.clone())),
        Json::Object(obj) => match obj.get("content") {
            Some(Json::String(s)) => Ok(Some(s.clone())),
            _ => Err(field_error(path, field, EXPECTED, value)),
        },
        _ => Err(field_error(path, field, EXPECTED, value)),
    }
}

fn optional_bool(
    path: &Path,
    cfg: &serde_json::Map<String, Json>,
    field: &str,
) -> Result<Option<bool>> {
    match cfg.get(field) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(field_error(path, field, "true or false", other)),
    }
}

/// Reads the special tokens of one config file into `special`, overriding what is there.
fn merge_special_tokens(
    path: &Path,
    cfg: &serde_json::Map<String, Json>,
    special: &mut SpecialTokens,
) -> Result<()> {
    for field in SPECIAL_TOKEN_FIELDS {
        if let Some(value) = cfg.get(field) {
            *special.slot(field) = token_content(path, field, value)?;
        }
    }
    if let Some(value) = cfg.get("additional_special_tokens") {
        let Json::Array(items) = value else {
            if value.is_null() {
                return Ok(());
            }
            return Err(field_error(
                path,
                "additional_special_tokens",
                "an array of strings or AddedToken objects",
                value,
            ));
        };
        let mut out = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            let field = format!("additional_special_tokens[{i}]");
            match token_content(path, &field, item)? {
                Some(tok) => out.push(tok),
                None => return Err(field_error(path, &field, "a token", item)),
            }
        }
        special.additional = out;
    }
    Ok(())
}

/// `chat_template` as HF stores it: a string, or a list of `{name, template}` objects.
fn parse_chat_template_field(path: &Path, value: &Json) -> Result<Vec<(String, String)>> {
    match value {
        Json::Null => Ok(Vec::new()),
        Json::String(s) => Ok(vec![("default".to_owned(), s.clone())]),
        Json::Array(items) => {
            let mut out = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                let field = format!("chat_template[{i}]");
                let name = item.get("name").and_then(Json::as_str);
                let template = item.get("template").and_then(Json::as_str);
                match (name, template) {
                    (Some(n), Some(t)) => out.push((n.to_owned(), t.to_owned())),
                    _ => {
                        return Err(field_error(
                            path,
                            &field,
                            "an object with string fields `name` and `template`",
                            item,
                        ))
                    }
                }
            }
            Ok(out)
        }
        other => Err(field_error(
            path,
            "chat_template",
            "a template string or a list of {\"name\", \"template\"} objects",
            other,
        )),
    }
}

/// `eos_token_id` in generation_config.json: an id, a list of ids, or null.
fn parse_id_list(path: &Path, field: &str, value: Option<&Json>) -> Result<Vec<u32>> {
    const EXPECTED: &str = "a token id (non-negative integer), a list of token ids, or null";
    let as_id = |v: &Json| v.as_u64().and_then(|n| u32::try_from(n).ok());
    match value {
        None | Some(Json::Null) => Ok(Vec::new()),
        Some(v @ Json::Number(_)) => as_id(v)
            .map(|id| vec![id])
            .ok_or_else(|| field_error(path, field, EXPECTED, v)),
        Some(Json::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                as_id(item)
                    .ok_or_else(|| field_error(path, &format!("{field}[{i}]"), EXPECTED, item))
            })
            .collect(),
        Some(other) => Err(field_error(path, field, EXPECTED, other)),
    }
}

/// HF's `clean_up_tokenization`: undo the spaces a word-level detokenizer leaves before
/// punctuation and English contractions.
fn clean_up_tokenization(text: &str) -> String {
    text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
}

impl Tokenizer {
    /// Loads a HF model folder. Only `tokenizer.json` is required; the other files are read
    /// when present, as transformers does.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        let tok_path = dir.join(TOKENIZER_FILE);
        let tok_text = read_text(
            &tok_path,
            "the tokenizer model; HF folders save it with save_pretrained",
        )?;
        let inner = tokenizers::Tokenizer::from_bytes(tok_text.as_bytes()).map_err(|e| {
            ChatError::TokenizerFile {
                path: tok_path.clone(),
                message: e.to_string(),
            }
        })?;

        let cfg_path = dir.join(TOKENIZER_CONFIG_FILE);
        let cfg = read_optional_json_object(&cfg_path)?.unwrap_or_default();
        let mut special = SpecialTokens::default();
        merge_special_tokens(&cfg_path, &cfg, &mut special)?;
        // transformers applies special_tokens_map.json on top of tokenizer_config.json.
        let map_path = dir.join(SPECIAL_TOKENS_MAP_FILE);
        if let Some(map) = read_optional_json_object(&map_path)? {
            merge_special_tokens(&map_path, &map, &mut special)?;
        }

        let bos_eos_policy = bos_eos_policy(&cfg_path, &cfg)?;
        let clean_up =
            optional_bool(&cfg_path, &cfg, "clean_up_tokenization_spaces")?.unwrap_or(false);
        let padding_side = match cfg.get("padding_side") {
            None | Some(Json::Null) => None,
            Some(Json::String(s)) if s == "left" || s == "right" => Some(s.clone()),
            Some(other) => {
                return Err(field_error(
                    &cfg_path,
                    "padding_side",
                    "\"left\" or \"right\"",
                    other,
                ))
            }
        };
        // Often a float sentinel like 1e30 meaning "no limit"; only a real integer counts.
        let model_max_length = cfg
            .get("model_max_length")
            .and_then(Json::as_u64)
            .filter(|n| *n < (1u64 << 53));

        let mut templates = Vec::new();
        if let Some(value) = cfg.get("chat_template") {
            templates = parse_chat_template_field(&cfg_path, value)?;
        }
        let json_tpl_path = dir.join(CHAT_TEMPLATE_JSON_FILE);
        if templates.is_empty() {
            if let Some(obj) = read_optional_json_object(&json_tpl_path)? {
                if let Some(value) = obj.get("chat_template") {
                    templates = parse_chat_template_field(&json_tpl_path, value)?;
                }
            }
        }
        // Newer folders keep the template in its own file; it wins over the JSON field.
        let jinja_path = dir.join(CHAT_TEMPLATE_FILE);
        if jinja_path.exists() {
            let text = read_text(&jinja_path, "chat template")?;
            templates.retain(|(name, _)| name != "default");
            templates.push(("default".into(), text));
        }
        let extra_dir = dir.join(ADDITIONAL_CHAT_TEMPLATES_DIR);
        if extra_dir.is_dir() {
            let entries = std::fs::read_dir(&extra_dir).map_err(|source| ChatError::Io {
                path: extra_dir.clone(),
                source,
            })?;
            for entry in entries {
                let entry = entry.map_err(|source| ChatError::Io {
                    path: extra_dir.clone(),
                    source,
                })?;
                let path = entry.path();
                if path.extension().and_then(|e| e.to_str()) != Some("jinja") {
                    continue;
                }
                let Some(name) = path.file_stem().and_then(|s| s.to_str()).map(str::to_owned)
                else {
                    continue;
                };
                let text = read_text(&path, "chat template")?;
                templates.retain(|(n, _)| *n != name);
                templates.push((name, text));
            }
        }
        let mut compiled = BTreeMap::new();
        for (name, source) in templates {
            let template = ChatTemplate::new(name.clone(), source)?;
            compiled.insert(name, template);
        }

        let gen_path = dir.join(GENERATION_CONFIG_FILE);
        let generation_eos_ids = match read_optional_json_object(&gen_path)? {
            Some(gen) => parse_id_list(&gen_path, "eos_token_id", gen.get("eos_token_id"))?,
            None => Vec::new(),
        };

        Self::assemble(
            inner,
            dir,
            special,
            bos_eos_policy,
            clean_up,
            padding_side,
            model_max_length,
            ChatTemplates {
                templates: compiled,
            },
            generation_eos_ids,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        mut inner: tokenizers::Tokenizer,
        dir: PathBuf,
        mut special: SpecialTokens,
        bos_eos_policy: Option<(bool, bool)>,
        clean_up_tokenization_spaces: bool,
        padding_side: Option<String>,
        model_max_length: Option<u64>,
        templates: ChatTemplates,
        generation_eos_ids: Vec<u32>,
    ) -> Result<Self> {
        // transformers truncates/pads only when asked per call; a policy saved inside
        // tokenizer.json must not silently apply to every encode.
        inner
            .with_truncation(None)
            .map_err(|e| ChatError::Tokenizer {
                operation: "configuration",
                message: e.to_string(),
            })?;
        inner.with_padding(None);

        // transformers registers every declared special token as a special added token (so it
        // is matched whole in text and skipped by skip_special_tokens), adding it to the
        // vocabulary when missing. Tokens tokenizer.json already lists keep their settings.
        let already_added: std::collections::HashSet<String> = inner
            .get_added_tokens_decoder()
            .into_values()
            .map(|t| t.content)
            .collect();
        let declared: Vec<String> = SPECIAL_TOKEN_FIELDS
            .iter()
            .filter_map(|f| special.get(f).cloned())
            .chain(special.additional.iter().cloned())
            .collect();
        let missing: Vec<AddedToken> = declared
            .iter()
            .filter(|t| !already_added.contains(*t))
            .map(|t| AddedToken::from(t.clone(), true))
            .collect();
        if !missing.is_empty() {
            inner.add_special_tokens(&missing);
        }

        // verl (and most trainers) set pad = eos when a tokenizer has no pad token.
        if special.pad.is_none() {
            special.pad = special.eos.clone();
        }
        let id_of = |tok: &Option<String>| tok.as_ref().and_then(|t| inner.token_to_id(t));
        let bos_id = id_of(&special.bos);
        let eos_id = id_of(&special.eos);
        let pad_id = id_of(&special.pad);

        if let Some((add_bos, add_eos)) = bos_eos_policy {
            let post = bos_eos_post_processor(&dir, &special, add_bos, bos_id, add_eos, eos_id)?;
            inner.with_post_processor(Some(post));
        }

        let mut eos_token_ids: Vec<u32> = eos_id.into_iter().collect();
        for id in &generation_eos_ids {
            if !eos_token_ids.contains(id) {
                eos_token_ids.push(*id);
            }
        }

        Ok(Tokenizer {
            inner,
            dir,
            special,
            bos_id,
            eos_id,
            pad_id,
            generation_eos_ids,
            eos_token_ids,
            clean_up_tokenization_spaces,
            padding_side,
            model_max_length,
            templates,
        })
    }

    /// Wraps an in-memory tokenizer (e.g. one from [`crate::train_bpe`]) with the given special
    /// tokens and an optional chat template; no files are involved.
    pub fn from_parts(
        inner: tokenizers::Tokenizer,
        special: SpecialTokens,
        chat_template: Option<&str>,
    ) -> Result<Self> {
        let mut templates = BTreeMap::new();
        if let Some(src) = chat_template {
            templates.insert("default".to_owned(), ChatTemplate::new("default", src)?);
        }
        Self::assemble(
            inner,
            PathBuf::from("<in memory>"),
            special,
            None,
            false,
            None,
            None,
            ChatTemplates { templates },
            Vec::new(),
        )
    }

    /// The folder this tokenizer was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The underlying `tokenizers` object, for batch APIs or offsets.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.special
    }

    /// Token ids of `text`. `add_special_tokens` applies the BOS/EOS policy (post-processor);
    /// special tokens written in the text are always recognised, as in transformers.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        self.inner
            .encode_fast(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| ChatError::Tokenizer {
                operation: "encode",
                message: e.to_string(),
            })
    }

    /// [`Self::encode`] over many texts, in parallel.
    pub fn encode_batch(&self, texts: &[&str], add_special_tokens: bool) -> Result<Vec<Vec<u32>>> {
        self.inner
            .encode_batch_fast(texts.to_vec(), add_special_tokens)
            .map(|encs| encs.into_iter().map(|e| e.get_ids().to_vec()).collect())
            .map_err(|e| ChatError::Tokenizer {
                operation: "encode",
                message: e.to_string(),
            })
    }

    /// Text of `ids`, with `clean_up_tokenization_spaces` applied when the config asks for it.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        let text =
            self.inner
                .decode(ids, skip_special_tokens)
                .map_err(|e| ChatError::Tokenizer {
                    operation: "decode",
                    message: e.to_string(),
                })?;
        Ok(if self.clean_up_tokenization_spaces {
            clean_up_tokenization(&text)
        } else {
            text
        })
    }

    /// [`Self::decode`] over many sequences.
    pub fn decode_batch(&self, batch: &[&[u32]], skip_special_tokens: bool) -> Result<Vec<String>> {
        batch
            .iter()
            .map(|ids| self.decode(ids, skip_special_tokens))
            .collect()
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// HF's `tokenizer.vocab_size`: the model vocabulary without added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(false)
    }

    /// HF's `len(tokenizer)`: vocabulary including added tokens. Embedding tables need at
    /// least this many rows.
    pub fn len(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// The tokenizer's own `eos_token` id (tokenizer_config.json).
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_id
    }

    /// Every id that ends generation: the tokenizer's eos first, then generation_config.json's
    /// `eos_token_id` entries not already listed.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    /// generation_config.json's `eos_token_id`, as given.
    pub fn generation_eos_token_ids(&self) -> &[u32] {
        &self.generation_eos_ids
    }

    /// The pad token id; the eos token's when the config declares no pad token (verl's rule).
    pub fn pad_token_id(&self) -> Option<u32> {
        self.pad_id
    }

    /// The id to pad batches with: the pad token, else the first eos id, else 0.
    pub fn padding_id(&self) -> u32 {
        self.pad_id
            .or(self.eos_token_ids.first().copied())
            .unwrap_or(0)
    }

    /// `padding_side` from tokenizer_config.json, if declared.
    pub fn padding_side(&self) -> Option<&str> {
        self.padding_side.as_deref()
    }

    pub fn model_max_length(&self) -> Option<u64> {
        self.model_max_length
    }

    pub fn chat_templates(&self) -> &ChatTemplates {
        &self.templates
    }

    /// This tokenizer with `source` as its one chat template, replacing the folder's (HF's
    /// `tokenizer.chat_template = source`, which verl's `model.custom_chat_template` does).
    pub fn with_chat_template(mut self, source: &str) -> Result<Self> {
        let template = ChatTemplate::new("default", source)?;
        self.templates = ChatTemplates {
            templates: BTreeMap::from([("default".to_string(), template)]),
        };
        Ok(self)
    }

    /// Renders `messages` with this folder's chat template, special tokens as variables (HF's
    /// `apply_chat_template(..., tokenize=False)`).
    pub fn apply_chat_template<M: Serialize>(
        &self,
        messages: &[M],
        opts: &ChatOptions,
    ) -> Result<String> {
        let template = self.templates.select(&self.dir, opts)?;
        template.render(messages, opts, &self.special.template_vars())
    }

    /// Renders and tokenizes like HF's `apply_chat_template(..., tokenize=True)`: the
    /// rendered text already holds every special token the template wants, so it is encoded
    /// with `add_special_tokens=false`.
    pub fn apply_chat_template_ids<M: Serialize>(
        &self,
        messages: &[M],
        opts: &ChatOptions,
    ) -> Result<Vec<u32>> {
        let text = self.apply_chat_template(messages, opts)?;
        self.encode(&text, false)
    }
}

/// Tokenizer classes whose transformers implementation rebuilds the post-processor from
/// `add_bos_token`/`add_eos_token` (`update_post_processor`), with the class defaults for
/// flags the config leaves out. Every other class (PreTrainedTokenizerFast, Qwen2, ...) keeps
/// tokenizer.json's post-processor and ignores the flags.
const BOS_EOS_CLASSES: &[(&str, bool, bool)] = &[
    ("LlamaTokenizer", true, false),
    ("CodeLlamaTokenizer", true, false),
    ("GemmaTokenizer", true, false),
    ("CohereTokenizer", true, false),
    ("GPTNeoXTokenizer", false, false),
];

/// `Some((add_bos, add_eos))` when the folder's `tokenizer_class` rebuilds its post-processor.
fn bos_eos_policy(
    path: &Path,
    cfg: &serde_json::Map<String, Json>,
) -> Result<Option<(bool, bool)>> {
    let add_bos = optional_bool(path, cfg, "add_bos_token")?;
    let add_eos = optional_bool(path, cfg, "add_eos_token")?;
    let class = match cfg.get("tokenizer_class") {
        None | Some(Json::Null) => return Ok(None),
        Some(Json::String(s)) => s.strip_suffix("Fast").unwrap_or(s),
        Some(other) => {
            return Err(field_error(
                path,
                "tokenizer_class",
                "a class name string",
                other,
            ))
        }
    };
    Ok(BOS_EOS_CLASSES
        .iter()
        .find(|(name, _, _)| *name == class)
        .map(|(_, bos, eos)| (add_bos.unwrap_or(*bos), add_eos.unwrap_or(*eos))))
}

/// The post-processor transformers' Llama/Gemma fast tokenizers build from `add_bos_token` /
/// `add_eos_token`: `[bos] $A [eos]` (and `[bos] $A [eos] [bos] $B [eos]` for pairs).
fn bos_eos_post_processor(
    dir: &Path,
    special: &SpecialTokens,
    add_bos: bool,
    bos_id: Option<u32>,
    add_eos: bool,
    eos_id: Option<u32>,
) -> Result<PostProcessorWrapper> {
    let cfg_path = dir.join(TOKENIZER_CONFIG_FILE);
    let mut specials: Vec<(String, u32)> = Vec::new();
    let mut prefix = String::new();
    let mut suffix = String::new();
    if add_bos {
        let (Some(tok), Some(id)) = (&special.bos, bos_id) else {
            return Err(ChatError::Field {
                path: cfg_path,
                field: "add_bos_token".into(),
                expected: "a `bos_token` to add".into(),
                found: "add_bos_token = true but no bos_token".into(),
            });
        };
        specials.push((tok.clone(), id));
        prefix = format!("{tok}:0 ");
    }
    if add_eos {
        let (Some(tok), Some(id)) = (&special.eos, eos_id) else {
            return Err(ChatError::Field {
                path: cfg_path,
                field: "add_eos_token".into(),
                expected: "an `eos_token` to add".into(),
                found: "add_eos_token = true but no eos_token".into(),
            });
        };
        if !specials.iter().any(|(t, _)| t == tok) {
            specials.push((tok.clone(), id));
        }
        suffix = format!(" {tok}:0");
    }
    let single = format!("{prefix}$A:0{suffix}");
    let pair = format!(
        "{single} {}$B:1{}",
        prefix.replace(":0", ":1"),
        suffix.replace(":0", ":1")
    );
    let template = TemplateProcessing::builder()
        .try_single(single.as_str())
        .and_then(|b| b.try_pair(pair.as_str()))
        .map_err(|e| ChatError::Field {
            path: dir.join(TOKENIZER_CONFIG_FILE),
            field: "bos_token/eos_token".into(),
            expected: "tokens without spaces (they go into a post-processor template)".into(),
            found: e,
        })?
        .special_tokens(specials)
        .build()
        .map_err(|e| ChatError::Tokenizer {
            operation: "post-processor construction",
            message: e.to_string(),
        })?;
    Ok(PostProcessorWrapper::Template(template))
}
