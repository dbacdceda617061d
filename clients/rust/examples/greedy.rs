//! The README's example: greedy decoding through the typed client.
use ferrum_rpc_client::{client::policy, ClientOptions, ExecutorClient};
use std::time::Duration;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let opts = ClientOptions { timeout: Some(Duration::from_secs(30)), ..Default::default() };
    let client = ExecutorClient::connect("127.0.0.1:50051", opts).await?;
    let prompt = [1u32, 504, 3458];
    let out = client.prefill(&prompt, None, Some(policy::argmax()), None).await?;
    let (mut token, mut handle) = (out.logits.unwrap().token_ids[0], out.kv_cache.unwrap());
    for _ in 0..16 {
        print!("{token} ");
        let step = client.decode(token, &handle, Some(policy::argmax()), None).await?;
        token = step.logits.unwrap().token_ids[0];
        handle = step.kv_cache.unwrap(); // the handle the last reply returned goes back
    }
    client.release_cache(&handle.cache_id).await?;
    Ok(())
}
