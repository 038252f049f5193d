//! Label and field selectors, parsed from query strings and matched against objects.

use serde_json::Value;

/// One label requirement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LabelRequirement {
    Equals(String, String),
    NotEquals(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

/// A conjunction of label requirements.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector(pub Vec<LabelRequirement>);

/// A conjunction of `field=value` / `field!=value` terms.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldSelector(pub Vec<(String, bool, String)>);

/// Splits on commas that are not inside parentheses.
fn split_top(input: &str) -> Result<Vec<&str>, String> {
    let mut parts = Vec::new();
    let mut depth = 0i32;
    let mut start = 0;
    for (i, c) in input.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth < 0 {
                    return Err("unbalanced parentheses".into());
                }
            }
            ',' if depth == 0 => {
                parts.push(&input[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err("unbalanced parentheses".into());
    }
    parts.push(&input[start..]);
    Ok(parts)
}

fn valid_key(key: &str) -> bool {
    !key.is_empty()
        && key.len() <= 317
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
}

fn valid_value(value: &str) -> bool {
    value.len() <= 63
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

fn parse_set(rest: &str) -> Result<Vec<String>, String> {
    let rest = rest.trim();
    let inner = rest
        .strip_prefix('(')
        .and_then(|r| r.strip_suffix(')'))
        .ok_or_else(|| format!("expected a parenthesised set, found {rest:?}"))?;
    let values: Vec<String> = inner
        .split(',')
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
        .collect();
    if values.is_empty() {
        return Err("a set must have at least one value".into());
    }
    if let Some(bad) = values.iter().find(|v| !valid_value(v)) {
        return Err(format!("invalid label value {bad:?}"));
    }
    Ok(values)
}

impl LabelSelector {
    pub fn parse(input: &str) -> Result<LabelSelector, String> {
        let input = input.trim();
        if input.is_empty() {
            return Ok(LabelSelector::default());
        }
        let mut reqs = Vec::new();
        for part in split_top(input)? {
            let part = part.trim();
            if part.is_empty() {
                return Err("empty requirement".into());
            }
            let req = if let Some(key) = part.strip_prefix('!') {
                LabelRequirement::NotExists(key.trim().to_string())
            } else if let Some((key, value)) = part.split_once("!=") {
                LabelRequirement::NotEquals(key.trim().into(), value.trim().into())
            } else if let Some((key, value)) = part.split_once("==") {
                LabelRequirement::Equals(key.trim().into(), value.trim().into())
            } else if let Some((key, value)) = part.split_once('=') {
                LabelRequirement::Equals(key.trim().into(), value.trim().into())
            } else if let Some(idx) = part.find(" notin ") {
                LabelRequirement::NotIn(part[..idx].trim().into(), parse_set(&part[idx + 7..])?)
            } else if let Some(idx) = part.find(" in ") {
                LabelRequirement::In(part[..idx].trim().into(), parse_set(&part[idx + 4..])?)
            } else {
                LabelRequirement::Exists(part.to_string())
            };
            let (key, value) = match &req {
                LabelRequirement::Equals(k, v) | LabelRequirement::NotEquals(k, v) => (k, Some(v)),
                LabelRequirement::In(k, _)
                | LabelRequirement::NotIn(k, _)
                | LabelRequirement::Exists(k)
                | LabelRequirement::NotExists(k) => (k, None),
            };
            if !valid_key(key) {
                return Err(format!("invalid label key {key:?}"));
            }
            if let Some(v) = value
                && !valid_value(v)
            {
                return Err(format!("invalid label value {v:?}"));
            }
            reqs.push(req);
        }
        Ok(LabelSelector(reqs))
    }

    pub fn matches(&self, object: &Value) -> bool {
        let labels = object
            .pointer("/metadata/labels")
            .and_then(Value::as_object);
        let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        self.0.iter().all(|req| match req {
            LabelRequirement::Equals(k, v) => get(k) == Some(v.as_str()),
            LabelRequirement::NotEquals(k, v) => get(k) != Some(v.as_str()),
            LabelRequirement::In(k, set) => get(k).is_some_and(|x| set.iter().any(|s| s == x)),
            LabelRequirement::NotIn(k, set) => !get(k).is_some_and(|x| set.iter().any(|s| s == x)),
            LabelRequirement::Exists(k) => get(k).is_some(),
            LabelRequirement::NotExists(k) => get(k).is_none(),
        })
    }
}

impl FieldSelector {
    /// Parses `a=b,c!=d`; `supported` says which fields the resource can select on.
    pub fn parse(input: &str, supported: impl Fn(&str) -> bool) -> Result<FieldSelector, String> {
        let input = input.trim();
        if input.is_empty() {
            return Ok(FieldSelector::default());
        }
        let mut terms = Vec::new();
        for part in input.split(',') {
            let (field, equal, value) = if let Some((f, v)) = part.split_once("!=") {
                (f, false, v)
            } else if let Some((f, v)) = part.split_once("==") {
                (f, true, v)
            } else if let Some((f, v)) = part.split_once('=') {
                (f, true, v)
            } else {
                return Err(format!("invalid field selector term {part:?}"));
            };
            let field = field.trim();
            if !supported(field) {
                return Err(format!("field label not supported: {field}"));
            }
            terms.push((field.to_string(), equal, value.trim().to_string()));
        }
        Ok(FieldSelector(terms))
    }

    pub fn matches(&self, value_of: impl Fn(&str) -> Option<String>) -> bool {
        self.0.iter().all(|(field, equal, value)| {
            let actual = value_of(field).unwrap_or_default();
            (actual == *value) == *equal
        })
    }

    /// The name this selector pins, if it has `metadata.name=X`.
    pub fn pinned_name(&self) -> Option<&str> {
        self.0
            .iter()
            .find(|(f, eq, _)| f == "metadata.name" && *eq)
            .map(|(_, _, v)| v.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn label_selectors() {
        let obj = json!({"metadata": {"labels": {"app": "web", "tier": "front"}}});
        let cases = [
            ("", true),
            ("app=web", true),
            ("app==web", true),
            ("app!=web", false),
            ("app in (web, db)", true),
            ("app notin (web,db)", false),
            ("tier", true),
            ("!tier", false),
            ("!missing", true),
            ("missing!=x", true),
            ("app=web,tier=back", false),
            ("app in (db),tier", false),
        ];
        for (sel, want) in cases {
            let parsed = LabelSelector::parse(sel).expect(sel);
            assert_eq!(parsed.matches(&obj), want, "{sel}");
        }
        for bad in ["app in web", "app in ()", "=x", "a b=c", "app=(x"] {
            assert!(LabelSelector::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn field_selectors() {
        let sel = FieldSelector::parse("metadata.name=a,status.phase!=Ready", |f| {
            f.starts_with("metadata.") || f == "status.phase"
        })
        .expect("parse");
        let value = |name: &str, phase: &str| {
            let (name, phase) = (name.to_string(), phase.to_string());
            move |f: &str| match f {
                "metadata.name" => Some(name.clone()),
                "status.phase" => Some(phase.clone()),
                _ => None,
            }
        };
        assert!(sel.matches(value("a", "Pending")));
        assert!(!sel.matches(value("a", "Ready")));
        assert!(!sel.matches(value("b", "Pending")));
        assert_eq!(sel.pinned_name(), Some("a"));
        assert!(FieldSelector::parse("spec.other=1", |_| false).is_err());
    }
}
