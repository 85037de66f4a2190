//! DSML, the markup `DeepSeek4Template` writes tools in (MindSpeed-LLM
//! `mindspeed_llm/tasks/preprocess/templates.py`, class `DeepSeek4Template`: `TOOLS_TEMPLATE`,
//! the tool-call branch of `_render_message`, `_encode_arguments_to_dsml`, `_to_json`): the tool
//! schemas of a system message, and an answer's tool calls as `invoke` blocks of `parameter`s.

use serde_json::{Map, Value};

use super::super::py_json;
use super::{THINKING_END, THINKING_START};

/// `DeepSeek4Template.DSML_TOKEN`.
const DSML: &str = "｜DSML｜";

/// `TOOLS_TEMPLATE` filled in: the instructions, then one schema per line (each tool's
/// `function` object as `json.dumps(…, ensure_ascii=False)` writes it).
pub(super) fn tools_prompt(functions: &[Value]) -> String {
    let schemas: Vec<String> = functions.iter().map(py_json).collect();
    let (d, ts, te) = (DSML, THINKING_START, THINKING_END);
    format!(
        "## Tools\n\n\
         You have access to a set of tools to help answer the user's question. \
         You can invoke tools by writing a \"<{d}tool_calls>\" block like the following:\n\n\
         <{d}tool_calls>\n\
         <{d}invoke name=\"$TOOL_NAME\">\n\
         <{d}parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</{d}parameter>\n\
         ...\n\
         </{d}invoke>\n\
         <{d}invoke name=\"$TOOL_NAME2\">\n\
         ...\n\
         </{d}invoke>\n\
         </{d}tool_calls>\n\n\
         String parameters should be specified as is and set `string=\"true\"`. \
         For all other types (numbers, booleans, arrays, objects), pass the value in JSON format \
         and set `string=\"false\"`.\n\n\
         If thinking_mode is enabled (triggered by {ts}), you MUST output your complete reasoning \
         inside {ts}...{te} BEFORE any tool calls or final response.\n\n\
         Otherwise, output directly after {te} with tool calls or final response.\n\n\
         ### Available Tool Schemas\n\n\
         {}\n\n\
         You MUST strictly follow the above defined tool name and parameter schemas to invoke \
         tool calls.\n",
        schemas.join("\n")
    )
}

/// Why a tool call's `arguments` cannot be written (upstream raises).
#[derive(Debug, Clone, PartialEq)]
pub(super) enum ArgumentsError {
    /// They parse to JSON that is not an object (`.items()` fails upstream).
    NotAnObject(&'static str),
    /// Python's `json` would read them (NaN or Infinity), serde_json does not.
    PythonOnly,
}

/// One tool call as an `invoke` block: `<｜DSML｜invoke name="…">`, its parameters, one a line
/// (none: an empty line), `</｜DSML｜invoke>`.
pub(super) fn invoke(name: &str, arguments: &Value) -> Result<String, ArgumentsError> {
    Ok(format!(
        "<{DSML}invoke name=\"{name}\">\n{}\n</{DSML}invoke>",
        parameters(arguments)?
    ))
}

/// An answer's tool calls: `\n\n<｜DSML｜tool_calls>`, the invoke blocks one a line, the end tag.
pub(super) fn tool_calls_block(invokes: &[String]) -> String {
    format!(
        "\n\n<{DSML}tool_calls>\n{}\n</{DSML}tool_calls>",
        invokes.join("\n")
    )
}

/// `_encode_arguments_to_dsml`: a JSON string of an object gives one parameter per key (a
/// string value as is, `string="true"`; any other as JSON, `string="false"`). Arguments that are
/// not a string, or a string that is not JSON, are the one parameter `arguments` (its
/// `json.loads` fails and the value is kept whole).
fn parameters(arguments: &Value) -> Result<String, ArgumentsError> {
    let parsed = match arguments {
        Value::String(text) => match parse_py_json(text) {
            Ok(Value::Object(map)) => Some(map),
            Ok(other) => return Err(ArgumentsError::NotAnObject(json_type(&other))),
            Err(ParseError::PythonOnly) => return Err(ArgumentsError::PythonOnly),
            Err(ParseError::Invalid(_)) => None,
        },
        _ => None,
    };
    let map = parsed.unwrap_or_else(|| {
        let mut whole = Map::new();
        whole.insert("arguments".into(), arguments.clone());
        whole
    });
    let lines: Vec<String> = map
        .iter()
        .map(|(key, value)| {
            let (is_str, text) = match value {
                Value::String(s) => ("true", s.clone()),
                other => ("false", py_json(other)),
            };
            format!("<{DSML}parameter name=\"{key}\" string=\"{is_str}\">{text}</{DSML}parameter>")
        })
        .collect();
    Ok(lines.join("\n"))
}

/// Why text is not JSON to `json.loads`.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum ParseError {
    /// Not JSON to Python either.
    Invalid(String),
    /// Not JSON to serde_json, but it holds `NaN` or `Infinity`, which Python's `json` reads:
    /// mindkit cannot tell, so refuses rather than guess.
    PythonOnly,
}

/// `json.loads(text)` (object keys in order, a repeated key keeping its first place and last
/// value, as both do).
pub(super) fn parse_py_json(text: &str) -> Result<Value, ParseError> {
    serde_json::from_str(text).map_err(|e| {
        if text.contains("NaN") || text.contains("Infinity") {
            ParseError::PythonOnly
        } else {
            ParseError::Invalid(e.to_string())
        }
    })
}

/// The Python type name of a JSON value, for errors.
pub(super) fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "None",
        Value::Bool(_) => "bool",
        Value::Number(n) if n.is_f64() => "float",
        Value::Number(_) => "int",
        Value::String(_) => "str",
        Value::Array(_) => "list",
        Value::Object(_) => "dict",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(arguments: Value) -> String {
        parameters(&arguments).unwrap()
    }

    #[test]
    fn string_values_are_written_as_is_and_others_as_python_json() {
        let arguments =
            r#"{"city": "東京", "days": 2, "l": [1.0, 1e-05, true, null], "o": {"a": "b"}}"#;
        assert_eq!(
            params(Value::String(arguments.into())),
            "<｜DSML｜parameter name=\"city\" string=\"true\">東京</｜DSML｜parameter>\n\
             <｜DSML｜parameter name=\"days\" string=\"false\">2</｜DSML｜parameter>\n\
             <｜DSML｜parameter name=\"l\" string=\"false\">[1.0, 1e-05, true, null]</｜DSML｜parameter>\n\
             <｜DSML｜parameter name=\"o\" string=\"false\">{\"a\": \"b\"}</｜DSML｜parameter>"
        );
        assert_eq!(params(Value::String("{}".into())), "");
    }

    #[test]
    fn arguments_that_are_not_a_json_object_string_are_one_parameter() {
        assert_eq!(
            params(Value::String("rust lang".into())),
            "<｜DSML｜parameter name=\"arguments\" string=\"true\">rust lang</｜DSML｜parameter>"
        );
        assert_eq!(
            params(serde_json::json!({"q": "x", "n": 3})),
            "<｜DSML｜parameter name=\"arguments\" string=\"false\">{\"q\": \"x\", \"n\": 3}</｜DSML｜parameter>"
        );
        assert_eq!(
            params(Value::Null),
            "<｜DSML｜parameter name=\"arguments\" string=\"false\">null</｜DSML｜parameter>"
        );
    }

    #[test]
    fn arguments_parsing_to_another_json_type_or_python_only_json_are_refused() {
        let fail = |s: &str| parameters(&Value::String(s.into())).unwrap_err();
        assert_eq!(fail("[1, 2]"), ArgumentsError::NotAnObject("list"));
        assert_eq!(fail("\"rust\""), ArgumentsError::NotAnObject("str"));
        assert_eq!(fail("{\"x\": NaN}"), ArgumentsError::PythonOnly);
    }

    #[test]
    fn an_invocation_and_the_calls_block() {
        let call = invoke("get_time", &Value::String("{}".into())).unwrap();
        assert_eq!(
            call,
            "<｜DSML｜invoke name=\"get_time\">\n\n</｜DSML｜invoke>"
        );
        assert_eq!(
            tool_calls_block(&[call.clone(), call]),
            "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_time\">\n\n</｜DSML｜invoke>\n\
             <｜DSML｜invoke name=\"get_time\">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
        );
    }

    #[test]
    fn the_tools_prompt_lists_one_schema_a_line() {
        let text = tools_prompt(&[
            serde_json::json!({"name": "a"}),
            serde_json::json!({"name": "b"}),
        ]);
        assert!(text.starts_with("## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke tools by writing a \"<｜DSML｜tool_calls>\" block"));
        assert!(text.contains("(triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE"));
        assert!(text.ends_with(
            "### Available Tool Schemas\n\n{\"name\": \"a\"}\n{\"name\": \"b\"}\n\n\
             You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
        ));
    }
}
