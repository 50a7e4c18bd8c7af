//! The MCP server and the agent offer a model the same tools: every MCP tool is an agent tool
//! of the same name, description and input schema, and the agent's others are the harness tools
//! (`plan`, `finish`), which need a work contract. Both lists come from `taskbox_tools`; this
//! test keeps either surface from growing a list of its own again.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation fails the test

use serde_json::Value;
use taskbox_tools::{HARNESS_TOOLS, SANDBOX_TOOLS};

#[test]
fn mcp_and_the_agent_offer_the_same_tool_definitions() {
    let mcp = taskbox_mcp::tool_list();
    let agent = taskbox_agent::tools::specs();

    let mcp_names: Vec<&str> = mcp.iter().map(|t| t.name.as_ref()).collect();
    let agent_names: Vec<&str> = agent.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(mcp_names, taskbox_mcp::TOOL_NAMES);
    assert_eq!(mcp_names, SANDBOX_TOOLS.map(|t| t.name()));
    let harness: Vec<&str> = HARNESS_TOOLS.iter().map(|t| t.name()).collect();
    assert_eq!(agent_names[..mcp_names.len()], mcp_names[..]);
    assert_eq!(agent_names[mcp_names.len()..], harness[..]);

    for (m, a) in mcp.iter().zip(&agent) {
        assert_eq!(
            m.description.as_deref(),
            Some(a.description.as_str()),
            "{}",
            a.name
        );
        assert_eq!(
            Value::Object(m.input_schema.as_ref().clone()),
            a.parameters,
            "{}: the schemas differ",
            a.name
        );
    }
}
