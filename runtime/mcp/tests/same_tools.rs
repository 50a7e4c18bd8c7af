//! The MCP server and the agent offer a model the same tools: every MCP sandbox tool is an agent
//! tool of the same name, description and input schema (MCP's with the `sandbox` argument added),
//! the MCP server's one more is the session tool `fork`, and the agent's others are the harness
//! tools (`plan`, `finish`), which need a work contract. Both lists come from `taskbox_tools`;
//! this test keeps either surface from growing a list of its own again.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation fails the test

use serde_json::Value;
use taskbox_tools::{HARNESS_TOOLS, SANDBOX_TOOLS, SESSION_TOOLS};

#[test]
fn mcp_and_the_agent_offer_the_same_tool_definitions() {
    let mcp = taskbox_mcp::tool_list();
    let agent = taskbox_agent::tools::specs();

    let mcp_names: Vec<&str> = mcp.iter().map(|t| t.name.as_ref()).collect();
    let agent_names: Vec<&str> = agent.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(mcp_names, taskbox_mcp::TOOL_NAMES);
    let sandbox: Vec<&str> = SANDBOX_TOOLS.iter().map(|t| t.name()).collect();
    let session: Vec<&str> = SESSION_TOOLS.iter().map(|t| t.name()).collect();
    assert_eq!(mcp_names[..sandbox.len()], sandbox[..]);
    assert_eq!(mcp_names[sandbox.len()..], session[..]);
    let harness: Vec<&str> = HARNESS_TOOLS.iter().map(|t| t.name()).collect();
    assert_eq!(agent_names[..sandbox.len()], sandbox[..]);
    assert_eq!(agent_names[sandbox.len()..], harness[..]);

    for (m, a) in mcp.iter().zip(&agent).take(sandbox.len()) {
        assert_eq!(
            m.description.as_deref(),
            Some(a.description.as_str()),
            "{}",
            a.name
        );
        let mut schema = m.input_schema.as_ref().clone();
        let props = schema["properties"].as_object_mut().unwrap();
        assert!(
            props.remove("sandbox").is_some(),
            "{}: no sandbox argument",
            a.name
        );
        assert_eq!(
            Value::Object(schema),
            a.parameters,
            "{}: the schemas differ",
            a.name
        );
    }
}
